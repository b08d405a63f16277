"""The staleness rule (AReaL's capacity rule), counted in groups.

A group (the answers to one prompt) may be submitted only while

    accepted + running < (max_staleness + steps + 1) * batch_size   and   running < max_concurrent

where ``accepted`` counts every group ever accepted into the queue, ``running`` the groups
submitted and not yet finished, and ``steps`` the training steps done: AReaL's policy version,
which a step bumps, except that a step whose every update was skipped (a NaN or inf gradient)
consumed its batch without making a new version; counting it by version would shrink the room
for good. Staleness itself is always measured against the version. Groups that
finish but are not accepted (filtered, failed, too stale) leave ``running`` without entering
``accepted``, so they free their place. ``max_staleness = 0`` is synchronous RL: the next
batch's prompts go out only after the trainer has bumped the version.

The rule bounds how far ahead rollout runs; it cannot by itself stop an early-submitted group
that finishes late from being consumed after newer ones. ``StalenessRule.bound_ok`` is the
check the controller makes before handing a trajectory to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessRule:
    """Counters and the two capacity conditions. Pure bookkeeping: no clocks, no I/O."""

    batch_size: int
    """Groups per training batch."""
    max_staleness: int
    """eta: the most versions a trained token may be older than the trainer."""
    max_concurrent: int
    """Cap on running groups, whatever the version."""
    version: int = 0
    accepted: int = 0
    running: int = 0
    steps: int | None = None
    """Training steps done; None: ``version`` (every step so far made a new version)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 group, got {self.batch_size}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (0 is synchronous RL), got {self.max_staleness}")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {self.max_concurrent}")
        if self.steps is None:
            self.steps = self.version

    @property
    def capacity(self) -> int:
        """How many more groups may be submitted now."""
        by_staleness = (self.max_staleness + self.steps + 1) * self.batch_size - (self.accepted + self.running)
        return max(0, min(by_staleness, self.max_concurrent - self.running))

    def can_submit(self) -> bool:
        return self.capacity > 0

    def on_submit(self) -> None:
        if not self.can_submit():
            raise RuntimeError(f"submit past capacity: {self}")
        self.running += 1

    def on_finish(self, accepted: bool) -> None:
        """A running group finished; ``accepted`` says whether it entered the queue."""
        if self.running <= 0:
            raise RuntimeError("a group finished that was never submitted")
        self.running -= 1
        self.accepted += int(accepted)

    def on_reject_accepted(self) -> None:
        """An accepted group was dropped before training (too stale by the time it was taken)."""
        self.accepted -= 1

    def set_version(self, version: int, steps: int | None = None) -> None:
        """The trainer's policy version after ``steps`` training steps (None: ``version`` of them)."""
        steps = version if steps is None else steps
        if version < self.version or steps < self.steps:
            raise ValueError(f"policy version or step count went back: {self.version} -> {version}, "
                             f"{self.steps} -> {steps} steps")
        if version > steps:
            raise ValueError(f"policy version {version} after only {steps} training steps")
        self.version, self.steps = version, steps

    def bound_ok(self, oldest_token_version: int) -> bool:
        """May a trajectory whose oldest trained token has this version be trained now?"""
        return self.version - oldest_token_version <= self.max_staleness
