"""Per-turn agent trajectories reach the advantages with their runs: the trainer gathers
``run_id`` and ``discount`` with the groups, so GRPO takes groups of uneven size (it stopped
with "groups must all have the same size" before) and counts each run once."""

import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from tests.trainer.helpers import random_trajectories, tiny_model


def test_preparer_normalises_per_turn_trajectories_over_runs() -> None:
    trajs = random_trajectories(np.random.default_rng(9), 2, 4)[:7]  # groups of 4 and 3
    # group 0: run 0 made three calls, run 1 one; group 1: runs of two and one call
    runs = [0, 0, 0, 1, 0, 0, 1]
    discounts = [0.25, 0.5, 1.0, 1.0, 0.5, 1.0, 1.0]
    run_reward = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 1.0, (1, 1): 1.0}
    for t, r, w in zip(trajs, runs, discounts, strict=True):
        t.run_id, t.discount, t.reward = r, w, w * run_reward[(t.group_id, r)]
    trainer = Trainer(tiny_model(), AlgoConfig(), TrainConfig(micro_batch_tokens=64, length_buckets=(64,)))
    adv = trainer.prepare_batch(trajs, 0).advantages  # computed on the packed rows, read back per trajectory
    # group 0's runs earned 1 and 0: mean 0.5, std sqrt(0.5); group 1's both earned 1: std 0
    expect = [w * (run_reward[(t.group_id, r)] - m) / (s + 1e-5)
              for t, r, w, (m, s) in zip(trajs, runs, discounts,
                                         [(0.5, np.sqrt(0.5))] * 4 + [(1.0, 0.0)] * 3, strict=True)]
    for a, t, e in zip(adv, trajs, expect, strict=True):
        np.testing.assert_allclose(a[t.loss_mask > 0], e, rtol=1e-5, atol=1e-6)
