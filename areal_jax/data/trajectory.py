"""``Trajectory``: one sampled answer as the rollout side hands it to the trainer.

Per-token arrays run over prompt + answer tokens and share one alignment convention: the value
stored at index ``i`` belongs to token ``i``. So ``behavior_logprobs[i]`` is
``log p(input_ids[i] | input_ids[:i])`` as the rollout engine reported it, and the trainer gets
the same quantity from the logits at position ``i - 1``. Index 0 has no predecessor, which is why
a prompt is at least one token long and prompt positions carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class TrajectoryError(ValueError):
    """A trajectory's fields disagree with each other; the message names the field."""


@dataclass
class Trajectory:
    """One answer to one prompt, with what the trainer needs to score and learn from it."""

    input_ids: np.ndarray
    """int32 ``[n]``: prompt tokens followed by answer tokens."""
    loss_mask: np.ndarray
    """``[n]``, 1 on answer tokens the policy is trained on, 0 on the prompt (and, in multi-turn
    workflows, on answer-side tokens the policy did not produce, such as tool output)."""
    behavior_logprobs: np.ndarray
    """float32 ``[n]``: logprob of token ``i`` given tokens ``< i`` under the policy that sampled
    it, ``log_softmax(logits / temperature)``; 0 on the prompt."""
    versions: np.ndarray
    """int32 ``[n]``: policy version that produced token ``i``; -1 on the prompt. An answer
    interrupted by a weight update mixes versions."""
    reward: float
    """Scalar task reward of the whole answer."""
    group_id: int
    """Answers to the same prompt share a group id; group-relative advantages use it."""
    prompt_len: int
    """Number of prompt tokens at the front of ``input_ids``."""
    truncated: bool = False
    """The answer was cut off at its length limit without an end-of-sequence token. With a critic,
    GAE then bootstraps from the value of the state after the last token instead of taking it as
    terminal (AReaL's ``no_eos`` mask)."""
    run_id: int = -1
    """Which agent run of its group produced it, when a run leaves several trajectories (the
    ``agentic`` workflow's ``trajectory: per_turn``): group-relative estimators then count each
    run once in the group statistics (``algo.advantages.run_group_scores``). -1: the
    trajectory is a group member of its own, the usual case."""
    discount: float = 1.0
    """The factor a per-turn trajectory's ``reward`` carries from its run's reward
    (``turn_discount ** later turns``); grouped by run, its baseline is discounted alike."""

    def __post_init__(self) -> None:
        self.input_ids = np.asarray(self.input_ids, np.int32)
        self.loss_mask = np.asarray(self.loss_mask, np.float32)
        self.behavior_logprobs = np.asarray(self.behavior_logprobs, np.float32)
        self.versions = np.asarray(self.versions, np.int32)
        self.reward = float(self.reward)
        self.group_id = int(self.group_id)
        self.prompt_len = int(self.prompt_len)
        self.truncated = bool(self.truncated)
        self.run_id = int(self.run_id)
        self.discount = float(self.discount)
        self.validate()

    @classmethod
    def from_prompt_and_answer(
        cls,
        prompt_ids: np.ndarray,
        answer_ids: np.ndarray,
        answer_logprobs: np.ndarray,
        answer_versions: np.ndarray | int,
        *,
        reward: float,
        group_id: int,
        truncated: bool = False,
    ) -> Trajectory:
        """Build from the pieces a ``/generate`` reply gives: the answer's tokens, logprobs and
        versions (one int when a single policy produced the whole answer)."""
        p, a = len(prompt_ids), len(answer_ids)
        versions = np.broadcast_to(np.asarray(answer_versions, np.int32), (a,))
        return cls(
            input_ids=np.concatenate([np.asarray(prompt_ids), np.asarray(answer_ids)]),
            loss_mask=np.concatenate([np.zeros(p), np.ones(a)]),
            behavior_logprobs=np.concatenate([np.zeros(p), np.asarray(answer_logprobs)]),
            versions=np.concatenate([np.full(p, -1), versions]),
            reward=reward,
            group_id=group_id,
            prompt_len=p,
            truncated=truncated,
        )

    def validate(self) -> None:
        n = len(self.input_ids)
        if self.input_ids.ndim != 1:
            raise TrajectoryError(f"input_ids must be 1-D, got shape {self.input_ids.shape}")
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise TrajectoryError(
                    f"{name} has shape {arr.shape}, but input_ids has {n} tokens; every per-token field "
                    f"runs over prompt + answer"
                )
        if not 1 <= self.prompt_len <= n:
            raise TrajectoryError(f"prompt_len={self.prompt_len} must be in 1..{n} (the token count)")
        if self.prompt_len == n or not self.loss_mask[self.prompt_len :].any():
            raise TrajectoryError(
                f"empty answer: loss_mask has no 1 after prompt_len={self.prompt_len} (of {n} tokens)"
            )
        prompt = slice(0, self.prompt_len)
        if self.loss_mask[prompt].any():
            raise TrajectoryError("loss_mask is nonzero on a prompt token; prompt tokens carry no loss")
        if (self.versions[prompt] != -1).any():
            i = int(np.flatnonzero(self.versions[prompt] != -1)[0])
            raise TrajectoryError(f"versions[{i}]={self.versions[i]} on a prompt token; prompt tokens carry -1")
        trained = self.loss_mask > 0
        if (self.versions[trained] < 0).any():
            raise TrajectoryError("versions is negative on a loss_mask token; the policy version that sampled it "
                                  "is needed for staleness and proximal logprobs")
        if not np.isfinite(self.behavior_logprobs).all() or (self.behavior_logprobs[trained] > 1e-4).any():
            raise TrajectoryError("behavior_logprobs must be finite and <= 0 on loss_mask tokens")
        if not np.isfinite(self.reward):
            raise TrajectoryError(f"reward is {self.reward}; it must be finite")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def answer_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def staleness(self, trainer_version: int) -> int:
        """``trainer_version`` minus the oldest version among the trained tokens."""
        return int(trainer_version - self.versions[self.loss_mask > 0].min())
