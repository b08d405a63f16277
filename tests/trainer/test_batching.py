"""Micro-batch planning: every trajectory once, budget kept, DP groups in step; the shift convention."""

import numpy as np
import pytest

from areal_jax.trainer import batching
from tests.trainer.helpers import random_trajectories


@pytest.mark.parametrize("dp_groups", [1, 4])
def test_plan_covers_each_trajectory_once_within_budget(dp_groups: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(4, 60, 37).tolist()
    plans = batching.plan_micro_batches(lengths, range(37), dp_groups=dp_groups, token_budget=64,
                                        min_micro_batches=2, buckets=(16, 32, 64))
    seen = sorted(i for p in plans for row in p.rows for i in row)
    assert seen == list(range(37))
    for p in plans:
        assert len(p.rows) == dp_groups
        loads = [sum(lengths[i] for i in row) for row in p.rows]
        assert max(loads) <= p.length <= 64
    assert len(plans) >= 2


def test_shift_then_unpack_round_trip() -> None:
    trajs = random_trajectories(np.random.default_rng(1), 3, 2)
    seqs = [batching.shifted_fields(t) for t in trajs]
    lengths = [len(t) for t in trajs]
    plan = batching.plan_micro_batches(lengths, range(len(trajs)), dp_groups=2, token_budget=64,
                                       min_micro_batches=1, buckets=(64,))[0]
    arrays = batching.pack_rows(seqs, plan)
    back = batching.unpack_rows(arrays["behavior_logprobs"], plan, lengths)
    for i, t in enumerate(trajs):
        np.testing.assert_array_equal(batching.unshift(back[i]), t.behavior_logprobs * (np.arange(len(t)) > 0))
        # position j's target is token j + 1, and the last position of a sequence trains on nothing
        got = batching.unpack_rows(arrays["targets"], plan, lengths)[i]
        np.testing.assert_array_equal(got[:-1], t.input_ids[1:])
        assert batching.unpack_rows(arrays["loss_mask"], plan, lengths)[i][-1] == 0
