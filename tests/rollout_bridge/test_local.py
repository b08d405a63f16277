"""The in-process rollout client: donation-safe handover of the trainer's params to an engine in
the same process, answers resumed across a handover with per-token versions, and the engine's
logprobs equal to the trainer's forward after a handover."""

from __future__ import annotations

import jax
import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from tests.trainer.helpers import random_trajectories, tiny_model

TRAIN = TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2)


def _values(tree: object) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]  # raises on a deleted (donated) array


def test_trainer_never_donates_the_model_it_was_given() -> None:
    model = tiny_model()  # an engine may be serving this very model
    before = _values(model)
    trainer = Trainer(model, AlgoConfig(), TRAIN)
    trainer.train_batch(random_trajectories(np.random.default_rng(0), 2, 4), 0)
    for a, b in zip(_values(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(_values(trainer.params), before, strict=True))


def test_lent_params_outlive_the_next_update_and_later_ones_are_donated_again() -> None:
    trainer = Trainer(tiny_model(), AlgoConfig(), TRAIN)
    trajs = random_trajectories(np.random.default_rng(1), 2, 4)
    lent = trainer.lend_params()
    before = _values(lent)
    trainer.train_batch(trajs, 0)
    for a, b in zip(_values(lent), before, strict=True):  # still readable, and unchanged
        np.testing.assert_array_equal(a, b)
    unlent = jax.tree.leaves(trainer.params)
    trainer.train_batch(trajs, 1)  # not lent: donated as before, so an update holds one copy
    assert all(x.is_deleted() for x in unlent)
