"""AlgoConfig validation, the YAML presets, and the advantage pipeline it drives."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from areal_jax.algo import (
    AlgoConfig,
    OverlongPenalty,
    compute_advantages,
    decoupled_ppo_loss,
    ppo_loss_kwargs,
)
from areal_jax.algo.config import ESTIMATORS
from areal_jax.config import from_dict, read_config_file

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "algo"


def _algo_section(name: str) -> dict:
    """A preset's ``algo:`` section, its ``include:`` files resolved."""
    return read_config_file(PRESETS / f"{name}.yaml")["algo"]


def _load(name: str) -> AlgoConfig:
    return from_dict(AlgoConfig, _algo_section(name))


AREAL_GRPO = lambda c: (c.adv_norm and c.reward_scale == 10.0 and c.reward_bias == -0.5  # noqa: E731
                        and c.use_decoupled_loss and c.behavior_imp_weight_cap == 5.0 and c.ppo_n_minibatches == 1)
PRESET_CHECKS = {
    "grpo": lambda c: c.adv_estimator == "grpo" and AREAL_GRPO(c) and c.eps_clip == 0.4,
    "dr_grpo": lambda c: c.adv_estimator == "dr_grpo" and AREAL_GRPO(c) and c.loss_aggregation == "token_mean",
    "rloo": lambda c: c.adv_estimator == "rloo" and AREAL_GRPO(c),
    "reinforce_pp": lambda c: c.adv_estimator == "reinforce_pp" and c.kl_coef == 0.001 and AREAL_GRPO(c),
    "ppo": lambda c: c.adv_estimator == "gae" and c.value_coef > 0 and c.value_eps_clip == 0.5 and AREAL_GRPO(c),
    "dapo": lambda c: (c.eps_clip, c.eps_clip_higher) == (0.2, 0.28)
    and c.overlong_penalty == OverlongPenalty(buffer_len=512, penalty_factor=1.0)
    and c.loss_aggregation == "token_mean" and c.kl_coef == 0.0 and AREAL_GRPO(c),
    "m2po": lambda c: c.adv_estimator == "grpo" and c.m2_threshold == 0.04 and c.eps_clip == 0.0 and AREAL_GRPO(c),
    "gspo": lambda c: c.ratio_level == "sequence" and c.eps_clip == 0.4 and AREAL_GRPO(c),
}  # fmt: skip


def test_every_preset_file_is_checked():
    assert {p.stem for p in PRESETS.glob("*.yaml")} == set(PRESET_CHECKS)


@pytest.mark.parametrize("name", sorted(PRESET_CHECKS))
def test_preset_loads_and_says_what_it_should(name):
    cfg = _load(name)
    assert PRESET_CHECKS[name](cfg)
    # Presets are run-config fragments: an algo section, perhaps on top of another preset.
    assert set(yaml.safe_load((PRESETS / f"{name}.yaml").read_text())) <= {"algo", "include"}


def test_unknown_keys_fail():
    with pytest.raises(TypeError):
        AlgoConfig(**{"eps_clip_hihger": 0.28})
    with pytest.raises(TypeError):
        AlgoConfig(overlong_penalty={"max_len": 10, "bufer_len": 2})


@pytest.mark.parametrize(
    "bad",
    [
        {"adv_estimator": "ppo"},
        {"ratio_level": "tokens"},
        {"loss_aggregation": "constant"},
        {"c_clip": 0.9},
        {"proximal_logprobs": "loglinear", "use_decoupled_loss": False},
        {"kl_estimator": "k4"},
        {"loss_aggregation": "constant", "constant_normalizer": 0.0},
        {"norm_eps": -1e-5},
        {"m2_threshold": 0.0},
        {"m2_threshold": 0.04, "use_decoupled_loss": False},
        {"use_behavior_imp_weight": False},  # the cap (5.0 by default) would drop by a weight not applied
        {"overlong_penalty": {"buffer_len": 0}},
        {"overlong_penalty": {"buffer_len": 8, "max_len": 4}},
    ],
)
def test_invalid_values_fail(bad):
    with pytest.raises(ValueError):
        AlgoConfig(**bad)


def test_estimator_table_covers_every_estimator():
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"}


def test_loss_kwargs_drive_the_loss():
    kw = ppo_loss_kwargs(_load("gspo"))
    assert kw["ratio_level"] == "sequence" and kw["aggregation"] == "token_mean"
    rng = np.random.default_rng(0)
    lp, prox, behav, adv = rng.normal(-1, 0.1, (4, 2, 6)).astype(np.float32)
    loss, _ = decoupled_ppo_loss(lp, prox, behav, adv, np.ones((2, 6), np.float32), **kw)
    assert np.isfinite(loss)
    assert ppo_loss_kwargs(_load("m2po"))["m2_threshold"] == 0.04


MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], np.float32)
SEQ_REWARDS = np.array([1.0, 0.0, 0.5, 2.0], np.float32)


def test_compute_advantages_grpo_with_overlong_and_shaping():
    cfg = AlgoConfig(
        reward_bias=1.0,
        reward_scale=2.0,
        overlong_penalty=OverlongPenalty(max_len=4, buffer_len=2, penalty_factor=1.0),
    )
    adv, returns = compute_advantages(cfg, SEQ_REWARDS, MASK, group_size=2)
    lengths = MASK.sum(1)
    penalty = np.where(lengths <= 2, 0.0, np.maximum((2 - lengths) / 2, -1.0))
    r = ((SEQ_REWARDS + penalty) + 1.0) * 2.0
    g = r.reshape(2, 2)
    seq_adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-5)).reshape(-1)
    np.testing.assert_allclose(adv, seq_adv[:, None] * MASK, rtol=1e-5, atol=1e-5)
    assert returns is None


def test_compute_advantages_gae_with_kl_and_norm():
    cfg = AlgoConfig(adv_estimator="gae", gamma=1.0, gae_lambda=1.0, kl_coef=0.1, adv_norm=False)
    values = np.zeros_like(MASK)
    kl = np.full_like(MASK, 0.5)
    adv, returns = compute_advantages(cfg, SEQ_REWARDS, MASK, values=values, token_kl=kl)
    # gamma = lambda = 1 and zero values: the advantage is the reward-to-go, KL included.
    token_r = -0.05 * MASK
    for b, n in enumerate(MASK.sum(1).astype(int)):
        token_r[b, n - 1] += SEQ_REWARDS[b]
    to_go = np.flip(np.cumsum(np.flip(token_r, 1), 1), 1) * MASK
    np.testing.assert_allclose(adv, to_go, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(returns, to_go, rtol=1e-5, atol=1e-6)
    normed, _ = compute_advantages(
        dataclasses.replace(cfg, adv_norm=True), SEQ_REWARDS, MASK, values=values, token_kl=kl
    )
    live = np.asarray(normed)[MASK > 0]
    assert abs(live.mean()) < 1e-5 and abs(live.std(ddof=1) - 1) < 1e-3


def test_compute_advantages_zero_kl_coef_ignores_kl():
    cfg = AlgoConfig(adv_estimator="rloo")
    with_kl, _ = compute_advantages(cfg, SEQ_REWARDS, MASK, group_size=2, token_kl=np.ones_like(MASK))
    without, _ = compute_advantages(cfg, SEQ_REWARDS, MASK, group_size=2)
    np.testing.assert_array_equal(with_kl, without)
    charged, _ = compute_advantages(
        dataclasses.replace(cfg, kl_coef=1.0), SEQ_REWARDS, MASK, group_size=2, token_kl=np.ones_like(MASK)
    )
    # Answers in a group differ in length, so charging KL per answer changes the advantages.
    assert not np.allclose(charged, without)


def test_negative_constant_normalizer_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="constant_normalizer must be positive, got -64.0"):
        AlgoConfig(loss_aggregation="constant", constant_normalizer=-64.0)
    with pytest.raises(ValueError, match="constant_normalizer must be positive"):
        AlgoConfig(constant_normalizer=-1.0)  # refused even while another aggregation is picked
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="constant_normalizer must be positive"):
        decoupled_ppo_loss(x, x, x, x, np.ones_like(x), eps_clip=0.2, aggregation="constant",
                           constant_normalizer=-2.0)


def test_norm_defaults_are_areals():
    cfg = AlgoConfig()
    assert cfg.std_unbiased is True and cfg.norm_eps == 1e-5
