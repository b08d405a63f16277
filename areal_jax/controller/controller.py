"""The rollout controller: submits prompts to workflows while the staleness rule allows, and
hands the trainer batches of groups that are within the bound.

Everything runs on one asyncio loop. A background task pulls prompt rows and starts one episode
(the workflow) per row whenever ``StalenessRule`` has capacity; finished groups are accepted
into the queue, filtered (all rewards equal, when DAPO's dynamic filtering is on) or counted as
failed. ``get_batch`` takes the oldest groups first and drops any that became staler than the
bound while they waited, so a batch never trains on a token more than ``max_staleness``
versions old; the prompt of a dropped group is submitted again (before new ones), so no prompt
is lost and the long answers, the ones that go stale, are not trained less often than short
ones. Rollout is reached only through the workflow's client, so the controller cannot
tell our embedded servers from SGLang or an in-process engine.

For checkpoints, ``state_dict`` is the controller's part of a run's state: the prompt iterator's
position, the counters, and the prompts submitted but not yet handed to the trainer (running or
waiting in the queue). ``load_state_dict`` puts it back in a new controller, which submits those
prompts again first, so a resumed run trains every prompt once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal_jax.controller.staleness import StalenessRule
from areal_jax.controller.workflow import Workflow, WorkflowError
from areal_jax.data.trajectory import Trajectory
from areal_jax.rewards.pool import RewardPoolBroken

log = logging.getLogger(__name__)


@dataclass
class Group:
    """The answers to one prompt, as one workflow call returned them."""

    row_id: str
    trajectories: list[Trajectory]
    serial: int = -1
    """Submission order, unique within a run; pending prompts are tracked by it."""

    @property
    def oldest_version(self) -> int:
        return min(int(t.versions[t.loss_mask > 0].min()) for t in self.trajectories)

    @property
    def generated_tokens(self) -> int:
        return sum(int(t.loss_mask.sum()) for t in self.trajectories)


@dataclass
class ControllerCounters:
    """Totals since the start of the run (the step's metrics report them)."""

    submitted: int = 0
    accepted: int = 0
    filtered: int = 0
    """Groups dropped by dynamic filtering (every reward equal)."""
    failed: int = 0
    """Episodes that raised or returned no trajectory."""
    stale_dropped: int = 0
    """Accepted groups dropped because they grew staler than the bound before being trained."""
    stale_requeued: int = 0
    """Prompts of stale-dropped groups put back in line to be submitted again."""
    stale_abandoned: int = 0
    """Prompts dropped for good after going stale ``MAX_STALE_REQUEUES + 1`` times."""
    filtered_in_a_row: int = 0
    """Groups filtered since the last accepted one: a run whose every group has equal rewards
    gets no learning signal, and ``get_batch`` says so instead of waiting for ever."""
    failed_in_a_row: int = 0
    """Episodes failed since the last one that returned a group (accepted or filtered): past
    ``failure_patience`` the workflow is taken to be broken and the run stops."""
    generated_tokens: int = 0
    failures: list[str] = field(default_factory=list)
    """The last few failure messages, with row ids."""


MAX_STALE_REQUEUES = 3
"""How many times one prompt is submitted again after its group went stale: a prompt whose
answers always outlast the bound would otherwise be generated for ever."""


def default_failure_patience(batch_size: int) -> int:
    """Failed episodes in a row that stop a run unless ``rollout.failure_patience`` says otherwise."""
    return max(50, 4 * batch_size)


class PromptsExhausted(RuntimeError):
    """The prompt iterator ended (its epochs are done) before a batch filled."""


class RolloutController:
    """Runs episodes in the background; ``await get_batch()`` returns ``batch_size`` groups."""

    def __init__(self, episode_client: Any, workflow: Workflow, rows: Iterator[Any], *, batch_size: int,
                 max_staleness: int, max_concurrent: int | None = None, filter_uniform_reward: bool = False,
                 version: int = 0, steps: int | None = None, filter_patience: int | None = None,
                 failure_patience: int | None = None):
        self.client = episode_client
        self.workflow = workflow
        self.rows = rows
        self.rule = StalenessRule(batch_size=batch_size, max_staleness=max_staleness,
                                  max_concurrent=max_concurrent or (max_staleness + 1) * batch_size,
                                  version=version, steps=steps,
                                  accepted=(version if steps is None else steps) * batch_size)
        self.filter_uniform_reward = filter_uniform_reward
        self.filter_patience = filter_patience or max(200, 20 * batch_size)
        if failure_patience is not None and failure_patience < 1:
            raise ValueError(f"rollout.failure_patience must be >= 1 (or None for the default), got {failure_patience}")
        self.failure_patience = failure_patience or default_failure_patience(batch_size)
        self._first_failure: tuple[str, BaseException | None] | None = None
        """The first failure of the current streak: its message (with traceback) and exception."""
        self.counters = ControllerCounters()
        self._ready: list[Group] = []
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._exhausted = False
        self._serial = 0
        self._pending: dict[int, Any] = {}
        """Rows submitted and not yet handed out in a batch (running, or accepted and waiting)."""
        self._stale_tries: dict[Any, int] = {}
        """Times each prompt's group went stale (by row id)."""
        self._resubmit: list[Any] = []
        """Rows of a restored controller's ``pending``, submitted again before new ones."""
        self._rows_state: Any = None
        """The prompt iterator's state after the last row taken from it."""
        self._held = False

    @property
    def version(self) -> int:
        return self.rule.version

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._submit_loop())

    async def stop(self) -> None:
        """Cancel the submit loop and every running episode."""
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None
        self._tasks.clear()

    def set_version(self, version: int, steps: int | None = None) -> None:
        """The trainer's policy version after ``steps`` training steps (None: ``version`` of them;
        more when a step made no new version): capacity grows with each step."""
        self.rule.set_version(version, steps)
        self._notify()

    async def drain(self) -> None:
        """Stop starting episodes and wait until the running ones end (``resume`` starts again):
        a weight update that waits for answers in flight instead of interrupting them."""
        self._held = True
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def resume(self) -> None:
        """Start episodes again after ``drain``."""
        self._held = False
        self._notify()

    def _notify(self) -> None:
        # Each wait holds the event current when it was asked for, and a notify sets that one and
        # starts a new one: a shared event cleared by whichever waiter woke first lost wakeups
        # (get_batch's wait, wrapped in ``wait_for``, starts a loop turn after its check; an
        # episode that finished meanwhile woke the submit loop, which cleared the event, and
        # get_batch then slept with a full batch ready).
        self._changed.set()
        self._changed = asyncio.Event()

    def _wait_change(self) -> Awaitable[bool]:
        """Resolves at the first ``_notify`` after this call (not after the first await)."""
        return self._changed.wait()

    async def _submit_loop(self) -> None:
        try:
            while self._error is None:  # a broken workflow or source takes no more prompts
                while self._held or not self.rule.can_submit():
                    await self._wait_change()
                if self._error is not None:
                    return
                if self._resubmit:
                    row = self._resubmit.pop(0)  # counted in ``submitted`` when first submitted
                elif self._exhausted:  # only a requeued prompt can come now
                    await self._wait_change()
                    continue
                else:
                    row, self._rows_state = await asyncio.to_thread(self._next_row)
                    if row is None:
                        self._exhausted = True
                        self._notify()
                        continue
                    self.counters.submitted += 1
                while self._held:  # a drain began while the row was read
                    await self._wait_change()
                if self._error is not None:
                    return
                self.rule.on_submit()
                serial, self._serial = self._serial, self._serial + 1
                self._pending[serial] = row
                task = asyncio.create_task(self._run_episode(row, serial))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the prompt source broke: surface it to get_batch
            self._error = e
            self._notify()

    def _next_row(self) -> tuple[Any, Any]:
        """The next row and the iterator's state just after it, taken together in one thread."""
        row = next(self.rows, None)
        return row, (self.rows.get_state() if hasattr(self.rows, "get_state") else None)

    def state_dict(self) -> dict[str, Any]:
        """JSON: the iterator's state after the last row taken, the pending rows' ids (those
        waiting to be submitted again first, then the submitted ones in submission order), and
        the counters. Take it between batches, when it matches the trainer's state."""
        pending = [*self._resubmit, *(self._pending[k] for k in sorted(self._pending))]
        return {"rows": self._rows_state, "counters": dict(vars(self.counters)),
                "pending": [getattr(r, "id", None) for r in pending]}

    def load_state_dict(self, state: dict[str, Any], rows_by_id: dict[str, Any]) -> None:
        """Continue a saved controller: call before ``start``, on a controller made with the saved
        version and step count (``accepted`` is then ``steps * batch_size``: each group accepted
        before the save was trained or is pending again). ``rows_by_id`` maps the pending ids to
        their rows."""
        if self._loop_task is not None:
            raise RuntimeError("load_state_dict goes before start()")
        missing = [i for i in state["pending"] if i not in rows_by_id]
        if missing:
            raise ValueError(f"the checkpoint's pending prompts {missing[:5]} are not in the dataset: did data change?")
        if state["rows"] is not None:
            if not hasattr(self.rows, "set_state"):
                raise ValueError("the prompt iterator cannot be restored (it has no set_state)")
            self.rows.set_state(state["rows"])
        self._rows_state = state["rows"]
        self._resubmit = [rows_by_id[i] for i in state["pending"]]
        self.counters = ControllerCounters(**state["counters"])

    async def _run_episode(self, row: Any, serial: int = -1) -> None:
        accepted = False
        try:
            trajs = await self.workflow(self.client, row)
            if not isinstance(trajs, list) or not all(isinstance(t, Trajectory) for t in trajs):
                raise WorkflowError(f"the workflow returned {type(trajs).__name__}, not a list of Trajectory")
            group = Group(getattr(row, "id", "?"), trajs, serial)
            self.counters.generated_tokens += group.generated_tokens if trajs else 0
            if not trajs:
                self._fail(row, "the episode produced no trajectory (every answer empty)")
            elif self.filter_uniform_reward and len({t.reward for t in trajs}) == 1:
                self.counters.filtered += 1
                self.counters.filtered_in_a_row += 1
                self._succeeded()
            else:
                self._ready.append(group)
                self.counters.accepted += 1
                self.counters.filtered_in_a_row = 0
                self._succeeded()
                accepted = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one bad episode never takes the run down
            self._fail(row, f"{type(e).__name__}: {e}", e)
            if isinstance(e, WorkflowError | RewardPoolBroken):
                self._error = e  # a wrong workflow or a pool that cannot score fails every episode: stop, loudly
        finally:
            if not accepted:
                self._pending.pop(serial, None)
            self.rule.on_finish(accepted)
            self._notify()

    def _succeeded(self) -> None:
        self.counters.failed_in_a_row = 0
        self._first_failure = None

    def _fail(self, row: Any, message: str, exc: BaseException | None = None) -> None:
        self.counters.failed += 1
        self.counters.failed_in_a_row += 1
        msg = f"row {getattr(row, 'id', '?')}: {message}"
        self.counters.failures = [*self.counters.failures[-9:], msg]
        if self._first_failure is None:  # the streak's first: the one worth a traceback
            tb = "".join(traceback.format_exception(exc)).rstrip() if exc is not None else ""
            self._first_failure = (f"{msg}\n{tb}" if tb else msg, exc)
            log.warning("episode failed: %s", self._first_failure[0])
        else:
            log.warning("episode failed: %s", msg)
        if self.counters.failed_in_a_row >= self.failure_patience and self._error is None:
            first, cause = self._first_failure
            err = RuntimeError(
                f"{self.counters.failed_in_a_row} episodes in a row failed (rollout.failure_patience="
                f"{self.failure_patience}): the workflow looks broken. The first of them:\n{first}")
            err.__cause__ = cause
            self._error = err

    async def get_batch(self, timeout: float | None = None) -> list[Group]:
        """``batch_size`` groups within the staleness bound, oldest first. Raises when the
        prompt source is exhausted before a batch fills, or the workflow is broken."""
        deadline = None if timeout is None else time.monotonic() + timeout
        n = self.rule.batch_size
        while True:
            self._drop_stale()
            if len(self._ready) >= n:
                self._ready.sort(key=lambda g: g.oldest_version)
                batch, self._ready = self._ready[:n], self._ready[n:]
                for g in batch:
                    self._pending.pop(g.serial, None)
                    self._stale_tries.pop(g.row_id, None)
                return batch
            if self._error is not None:
                if isinstance(self._error, RuntimeError) and self._error.__cause__ is not None:
                    raise self._error  # the failure budget's own error, cause attached
                raise RuntimeError(f"rollout stopped: {self._error}") from self._error
            if self.counters.filtered_in_a_row >= self.filter_patience:
                raise RuntimeError(
                    f"the last {self.counters.filtered_in_a_row} groups all had equal rewards within the group, so "
                    "dynamic filtering dropped them and no batch can fill: the policy gets no signal. Warm the "
                    "model up (warm_start), make the task easier, or set rollout.filter_uniform_reward=false")
            if self._exhausted and not self.rule.running and not self._resubmit:
                raise PromptsExhausted(f"the prompt source ran out before a batch of {n} groups filled "
                                       f"({len(self._ready)} ready)")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"no batch of {n} groups within {timeout}s ({len(self._ready)} ready, "
                                   f"{self.rule.running} running; last failures: {self.counters.failures[-3:]})")
            try:
                await asyncio.wait_for(self._wait_change(), remaining)
            except TimeoutError:
                continue

    def _drop_stale(self) -> None:
        keep, requeue = [], []
        for g in self._ready:
            if self.rule.bound_ok(g.oldest_version):
                keep.append(g)
            else:
                self.rule.on_reject_accepted()
                self.counters.stale_dropped += 1
                row = self._pending.pop(g.serial, None)
                if row is None:
                    continue
                key = getattr(row, "id", id(row))
                tries = self._stale_tries[key] = self._stale_tries.get(key, 0) + 1
                if tries <= MAX_STALE_REQUEUES:
                    requeue.append(row)
                    self.counters.stale_requeued += 1
                else:  # its answers outlast the bound every time: more tries would only burn compute
                    self.counters.stale_abandoned += 1
                    log.warning("prompt %s went stale %d times in a row (its answers take longer than "
                                "rollout.max_staleness=%d versions); dropped for good. Raise max_staleness to keep "
                                "such prompts", key, tries, self.rule.max_staleness)
        # Ahead of new prompts: they were drawn first, and a resumed run submits them first too.
        self._resubmit[:0] = requeue
        if len(keep) != len(self._ready):
            self._ready = keep
            self._notify()
