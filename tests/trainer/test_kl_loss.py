"""The KL loss term (``algo.kl_loss_coef``, verl's ``use_kl_loss``) in the trainer: the
reference's logprobs reach the loss aligned with the policy's, the term joins the loss, and
the reward-penalty path (``kl_coef``) is left alone. Two training steps each."""

import numpy as np
import pytest

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from tests.trainer.helpers import random_trajectories, tiny_model

TEMPERATURE = 0.8
COEF = 0.5


def test_kl_loss_term_over_two_steps() -> None:
    trajs = random_trajectories(np.random.default_rng(7), 2, 4)
    cfg = TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2, temperature=TEMPERATURE)
    with_kl = Trainer(tiny_model(), AlgoConfig(kl_loss_coef=COEF), cfg)
    without = Trainer(tiny_model(), AlgoConfig(), cfg)
    assert with_kl.ref_params is not None and without.ref_params is None

    first = with_kl.train_batch(trajs, 0)
    first_plain = without.train_batch(trajs, 0)
    # the policy starts as the reference: k3 is 0 there and so is its gradient, the steps agree
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(first_plain["loss"], rel=1e-5, abs=1e-7)
    assert "kl_ref_mean" not in first  # no reward penalty: kl_coef is 0

    # step 2: the policy has moved; the term is verl's low_var_kl token mean of the current
    # logprobs against the reference's, and it is added to the loss with its coefficient
    current = with_kl.compute_logprobs(trajs)
    ref = with_kl.compute_logprobs(trajs, reference=True)
    mask = [t.loss_mask for t in trajs]
    d = [np.clip(r - c, -20, 20) for c, r in zip(current, ref, strict=True)]
    k3 = sum(((np.exp(x) - x - 1) * m).sum() for x, m in zip(d, mask, strict=True)) / sum(m.sum() for m in mask)
    assert k3 > 1e-5
    second = with_kl.train_batch(trajs, 1)
    second_plain = without.train_batch(trajs, 1)
    assert second["kl_loss"] == pytest.approx(k3, rel=2e-3)
    assert second["loss"] - second_plain["loss"] == pytest.approx(COEF * k3, rel=2e-2)
