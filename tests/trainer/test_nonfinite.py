"""A NaN or inf in the loss or gradients: the optimizer step is skipped on device (params and
optimizer state unchanged), counted in ``skipped_steps``, and a finite batch afterwards trains."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import Trainer
from areal_jax.trainer.config import TrainConfig
from tests.trainer.helpers import random_trajectories, tiny_model


def _host(tree: object) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b, strict=True))


def _poison(trajectories: list, how: str, which: slice) -> None:
    for t in trajectories[which]:
        if how == "reward_inf":
            t.reward = float("inf")
        else:  # a NaN behavior logprob on an answer token: NaN ratio, NaN loss
            lp = t.behavior_logprobs.copy()
            lp[np.flatnonzero(t.loss_mask)[0]] = np.nan
            t.behavior_logprobs = lp


@pytest.mark.slow
@pytest.mark.parametrize("how", ["reward_inf", "logprob_nan"])
def test_nonfinite_batch_changes_nothing_and_is_counted(how: str) -> None:
    rng = np.random.default_rng(0)
    trainer = Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=2), TrainConfig(lr=1e-2))
    params0, opt0 = _host(trainer.policy.params), _host(trainer.policy.opt_state)

    bad = random_trajectories(rng, num_groups=2, group_size=4)
    _poison(bad, how, slice(None))
    stats = trainer.train_batch(bad, version=0)
    assert stats["skipped_steps"] == 2 and trainer.skipped_steps == 2 and trainer.policy.step == 0
    assert not np.isfinite(stats["grad_norm"])  # no applied step to report a norm for
    assert _same(_host(trainer.policy.params), params0)
    assert _same(_host(trainer.policy.opt_state), opt0)  # moments and step count untouched

    stats = trainer.train_batch(random_trajectories(rng, num_groups=2, group_size=4), version=0)
    assert stats["skipped_steps"] == 0 and trainer.policy.step == 2 and np.isfinite(stats["grad_norm"])
    after = _host(trainer.policy.params)
    assert all(np.isfinite(x).all() for x in after)
    assert not _same(after, params0)


@pytest.mark.slow
def test_only_the_poisoned_minibatch_is_skipped() -> None:
    rng = np.random.default_rng(1)
    trainer = Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=2), TrainConfig(lr=1e-2))
    batch = random_trajectories(rng, num_groups=2, group_size=4)
    _poison(batch, "logprob_nan", slice(4, None))  # the second minibatch's trajectories
    stats = trainer.train_batch(batch, version=0)
    assert stats["skipped_steps"] == 1 and trainer.policy.step == 1 and np.isfinite(stats["grad_norm"])
    assert all(np.isfinite(x).all() for x in _host(trainer.policy.params))
    counts = [int(x) for x in jax.tree.leaves(trainer.policy.opt_state) if np.ndim(x) == 0]
    assert counts and all(c == 1 for c in counts)  # Adam took one step, not two
