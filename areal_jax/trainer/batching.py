"""From trajectories to fixed-shape micro-batch arrays and back (host side, NumPy only).

Two conventions meet here. A ``Trajectory`` stores at index ``i`` what belongs to token ``i``;
a causal model's output at position ``j`` predicts token ``j + 1``. ``shifted_fields`` moves every
per-token field one place left once, so that inside the trainer position ``j`` of a packed row
holds the target token ``j + 1`` with its mask, behavior logprob, version and advantage, and the
last position of each sequence (which predicts nothing) has mask 0. ``unshift`` undoes it.

A micro-batch is ``[dp_groups, length]``: one packed row per data-parallel group, the row axis
sharded over the groups, ``length`` a bucket so that the number of compiled shapes stays small.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from areal_jax.data.packing import (
    bucket_length,
    build_packed_batch,
    equalize_micro_batch_count,
    pack_first_fit_decreasing,
)
from areal_jax.data.trajectory import Trajectory


def _shift_left(x: np.ndarray, fill: float) -> np.ndarray:
    out = np.full_like(x, fill)
    out[:-1] = x[1:]
    return out


def shifted_fields(traj: Trajectory) -> dict[str, np.ndarray]:
    """Per-position training fields of one trajectory: position ``j`` carries token ``j + 1``'s data."""
    return {
        "input_ids": traj.input_ids,
        "targets": _shift_left(traj.input_ids, 0),
        "loss_mask": _shift_left(traj.loss_mask, 0.0),
        "behavior_logprobs": _shift_left(traj.behavior_logprobs, 0.0),
        "versions": _shift_left(traj.versions, -1),
    }


def shift_token_values(values: np.ndarray) -> np.ndarray:
    """Index-``i`` convention (value of token ``i``) to the position convention (value at ``i - 1``)."""
    return _shift_left(np.asarray(values, np.float32), 0.0)


def unshift(values: np.ndarray) -> np.ndarray:
    """Position convention back to index ``i``: index 0 (no predecessor) gets 0."""
    out = np.zeros_like(values)
    out[1:] = values[:-1]
    return out


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which trajectories go in each packed row of one micro-batch, and the row length."""

    rows: tuple[tuple[int, ...], ...]
    """Per data-parallel group, indices into the batch's trajectory list, packed in this order."""
    length: int
    """Bucketed row length (tokens)."""

    def real_tokens(self, lengths: Sequence[int]) -> int:
        return sum(int(lengths[i]) for row in self.rows for i in row)


def plan_micro_batches(
    lengths: Sequence[int],
    indices: Sequence[int],
    *,
    dp_groups: int,
    token_budget: int,
    min_micro_batches: int,
    buckets: Sequence[int],
) -> list[MicroBatchPlan]:
    """Pack ``indices`` (sequences of ``lengths``) into micro-batches every DP group runs in step.

    First-fit-decreasing fills rows up to ``token_budget``; rows are dealt to groups, heaviest
    first, to the group with the fewest (then lightest) rows; groups short of the largest count
    split a row (``equalize_micro_batch_count``) so all groups run the same number of
    micro-batches. Within a group rows go heaviest first, so micro-batch ``k`` pairs rows of
    similar length and its bucket wastes little on the lighter groups.
    """
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("cannot plan micro-batches for an empty minibatch")
    sub = [int(lengths[i]) for i in indices]
    want = min(len(indices), dp_groups * min_micro_batches)
    bins = [[indices[j] for j in b] for b in pack_first_fit_decreasing(sub, token_budget, want)]
    load = lambda b: sum(int(lengths[i]) for i in b)
    groups: list[list[list[int]]] = [[] for _ in range(dp_groups)]
    for b in sorted(bins, key=lambda b: -load(b)):
        g = min(range(dp_groups), key=lambda g: (len(groups[g]), sum(map(load, groups[g]))))
        groups[g].append(b)
    groups = equalize_micro_batch_count(groups, lengths)
    for g in groups:
        g.sort(key=lambda b: -load(b))
    plans = []
    for k in range(len(groups[0])):
        rows = tuple(tuple(g[k]) for g in groups)
        plans.append(MicroBatchPlan(rows, bucket_length(max(load(r) for r in rows), buckets)))
    return plans


def padded_plan(lengths: Sequence[int], indices: Sequence[int], buckets: Sequence[int]) -> MicroBatchPlan:
    """One sequence per row, right-padded to the bucket of the longest: the unpacked layout."""
    indices = [int(i) for i in indices]
    return MicroBatchPlan(tuple((i,) for i in indices), bucket_length(max(int(lengths[i]) for i in indices), buckets))


def pack_rows(seqs: Sequence[Mapping[str, np.ndarray]], plan: MicroBatchPlan) -> dict[str, np.ndarray]:
    """The micro-batch arrays ``[rows, length]`` of ``plan``, plus ``segment_ids`` and ``positions``."""
    rows = [build_packed_batch(seqs, row, plan.length) for row in plan.rows]
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def row_sequences(plan: MicroBatchPlan, segment_ids: np.ndarray) -> np.ndarray:
    """``int32 [rows, length]``: each position's index into the batch (-1 on padding), from the
    packed rows' ``segment_ids`` (1..k per row): what per-sequence quantities are looked up by."""
    return np.stack([np.array([-1, *row], np.int32)[seg] for row, seg in zip(plan.rows, segment_ids, strict=True)])


def unpack_rows(values: np.ndarray, plan: MicroBatchPlan, lengths: Sequence[int]) -> dict[int, np.ndarray]:
    """Slice per-position ``values [rows, length]`` back into each trajectory's ``[n]`` array."""
    out = {}
    for r, row in enumerate(plan.rows):
        start = 0
        for i in row:
            n = int(lengths[i])
            out[i] = np.asarray(values[r, start : start + n])
            start += n
    return out
