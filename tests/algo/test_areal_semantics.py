"""AReaL's advantage semantics against a NumPy transcription of its formulas (written here):
the KL penalty is a per-token reward added after the task reward's group normalisation, the
advantage is GAE over the loss mask (zero values without a critic: the reward-to-go), tokens off
the mask are skipped rather than cutting the recursion, and REINFORCE++ whitens over tokens."""

import dataclasses

import jax
import numpy as np
import pytest

from areal_jax.algo import AlgoConfig, compute_advantages, gae_advantages

RNG = np.random.default_rng(0)


def np_areal_gae(rewards, values, mask, gamma, lam, bootstrap=None):
    """AReaL's backward loop: a masked-off token leaves the running value and advantage as they
    were, so the recursion jumps the gap; the value after the last token is 0, or for an answer
    cut off without EOS its bootstrap value (AReaL's ``nextvalues = values[:, -1] * no_eos``)."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for b in range(rewards.shape[0]):
        next_value, last = (0.0 if bootstrap is None else float(bootstrap[b])), 0.0
        for t in reversed(range(rewards.shape[1])):
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            new = delta + gamma * lam * last
            if mask[b, t]:
                next_value, last = values[b, t], new
            adv[b, t] = last
    return adv * mask


def np_token_rewards(scores, kl, mask, kl_coef):
    r = -kl_coef * kl * mask
    for b in range(mask.shape[0]):
        r[b, np.nonzero(mask[b])[0][-1]] += scores[b]  # the task reward on the last trained token
    return r


def np_group_norm(r, group_size, kind, eps=1e-5):
    g = r.reshape(-1, group_size).astype(np.float64)
    mean = g.mean(1, keepdims=True)
    if kind == "grpo":  # AReaL's NormConfig defaults: std_unbiased=True, eps=1e-5
        out = (g - mean) / (g.std(1, ddof=1, keepdims=True) + eps)
    elif kind == "dr_grpo":
        out = g - mean
    else:  # rloo
        out = g - (g.sum(1, keepdims=True) - g) / (group_size - 1)
    return out.reshape(-1)


def np_whiten(x, mask, eps=1e-5):
    live = x[mask > 0]
    return (x - live.mean()) / (live.std(ddof=1) + eps) * mask


def random_multi_turn_masks(batch, width, rng):
    """Prompt, then answer turns separated by masked environment tokens, then padding."""
    mask = np.zeros((batch, width), np.float32)
    for b in range(batch):
        t = int(rng.integers(1, 4))
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(1, 4))
            mask[b, t : t + n] = 1
            t += n + int(rng.integers(1, 3))
            if t >= width - 4:
                break
    return mask


def test_first_turn_of_a_multi_turn_answer_gets_the_terminal_reward():
    mask = np.array([0, 0, 1, 1, 0, 0, 1, 1], np.float32)
    reward = np.zeros(8, np.float32)
    reward[-1] = 1.0
    adv, ret = gae_advantages(reward, np.zeros(8, np.float32), mask, gamma=1.0, gae_lambda=1.0)
    np.testing.assert_allclose(adv, mask)
    np.testing.assert_allclose(ret, mask)
    # Discounting counts trained tokens only: the gap between turns costs nothing.
    adv, _ = gae_advantages(reward, np.zeros(8, np.float32), mask, gamma=0.5, gae_lambda=1.0)
    np.testing.assert_allclose(adv, [0, 0, 0.125, 0.25, 0, 0, 0.5, 1.0])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_across_masked_gaps_vs_reference(gamma, lam):
    mask = random_multi_turn_masks(6, 16, RNG)
    rewards = (RNG.normal(size=mask.shape) * mask).astype(np.float32)
    values = np.where(mask > 0, RNG.normal(size=mask.shape), 50.0).astype(np.float32)  # garbage off the mask
    adv, ret = jax.jit(lambda *a: gae_advantages(*a, gamma=gamma, gae_lambda=lam))(rewards, values, mask)
    ref = np_areal_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, (ref + values) * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_kl_reward_is_added_after_group_normalisation(estimator, multi_turn):
    """The group's std divides the task reward only; each token's KL reward stays where it was
    incurred and reaches the earlier tokens through the reward-to-go."""
    mask = random_multi_turn_masks(8, 16, RNG) if multi_turn else \
        np.array([[0] * 2 + [1] * n + [0] * (14 - n) for n in (3, 7, 5, 12, 1, 9, 4, 6)], np.float32)
    rewards = RNG.normal(size=8).astype(np.float32)
    kl = RNG.normal(size=mask.shape).astype(np.float32) ** 2
    cfg = AlgoConfig(adv_estimator=estimator, kl_coef=0.3, gamma=1.0, gae_lambda=1.0)
    adv, returns = compute_advantages(cfg, rewards, mask, group_size=4, token_kl=kl)
    scores = np_group_norm(rewards, 4, estimator)
    ref = np_areal_gae(np_token_rewards(scores, kl, mask, 0.3), np.zeros_like(mask), mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    assert returns is None
    # With a discount the reward-to-go discounts by gamma * lambda per trained token, as AReaL.
    cfg = dataclasses.replace(cfg, gamma=0.9, gae_lambda=0.8)
    adv, _ = compute_advantages(cfg, rewards, mask, group_size=4, token_kl=kl)
    ref = np_areal_gae(np_token_rewards(scores, kl, mask, 0.3), np.zeros_like(mask), mask, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)


def test_reinforce_pp_whitens_over_tokens():
    """No group baseline; the reward-to-go (KL included) whitened over the batch's trained tokens,
    so with answers of different lengths it is not a per-sequence whitening."""
    mask = np.array([[1] * n + [0] * (10 - n) for n in (2, 10, 5, 7)], np.float32)
    rewards = np.array([1.0, 0.0, 0.5, 2.0], np.float32)
    kl = RNG.normal(size=mask.shape).astype(np.float32) ** 2
    for kl_coef in (0.0, 0.2):
        cfg = AlgoConfig(adv_estimator="reinforce_pp", kl_coef=kl_coef)
        adv, _ = compute_advantages(cfg, rewards, mask, token_kl=kl)
        token_r = np_token_rewards(rewards, kl, mask, kl_coef)
        ref = np_whiten(np_areal_gae(token_r, np.zeros_like(mask), mask, 1.0, 1.0), mask)
        np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    live = np.asarray(adv)[mask > 0]
    assert abs(live.mean()) < 1e-5 and abs(live.std(ddof=1) - 1) < 1e-3


def test_gae_estimator_with_kl_across_turns_vs_reference():
    mask = random_multi_turn_masks(4, 16, RNG)
    rewards = RNG.normal(size=4).astype(np.float32)
    values = RNG.normal(size=mask.shape).astype(np.float32)
    kl = RNG.normal(size=mask.shape).astype(np.float32) ** 2
    cfg = AlgoConfig(adv_estimator="gae", kl_coef=0.1, gamma=0.99, gae_lambda=0.95)
    adv, returns = compute_advantages(cfg, rewards, mask, values=values, token_kl=kl)
    ref = np_areal_gae(np_token_rewards(rewards, kl, mask, 0.1), values * mask, mask, 0.99, 0.95)
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, (ref + values) * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_bootstraps_truncated_answers_from_their_last_value(gamma, lam):
    """An answer cut off at the length limit (no EOS) is not an ended episode: the value after
    its last token is the critic's, as in AReaL; a finished answer's is 0."""
    mask = random_multi_turn_masks(6, 16, RNG)
    rewards = RNG.normal(size=6).astype(np.float32)
    values = RNG.normal(size=mask.shape).astype(np.float32)
    truncated = np.array([True, False, True, False, True, True])
    last_values = RNG.normal(size=6).astype(np.float32) * 3
    cfg = AlgoConfig(adv_estimator="gae", gamma=gamma, gae_lambda=lam)
    adv, returns = compute_advantages(cfg, rewards, mask, values=values, truncated=truncated, last_values=last_values)
    token_r = np_token_rewards(rewards, np.zeros_like(mask), mask, 0.0)
    ref = np_areal_gae(token_r, values * mask, mask, gamma, lam, bootstrap=np.where(truncated, last_values, 0.0))
    np.testing.assert_allclose(adv, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returns, (ref + values) * mask, rtol=1e-5, atol=1e-5)
    # The bootstrap moves the truncated rows and only them.
    plain, _ = compute_advantages(cfg, rewards, mask, values=values)
    moved = np.abs(np.asarray(adv) - np.asarray(plain)).max(axis=1) > 1e-3
    np.testing.assert_array_equal(moved, truncated)
    with pytest.raises(ValueError, match="last_values"):
        compute_advantages(cfg, rewards, mask, values=values, truncated=truncated)
    # Critic-free estimators have zero values everywhere, the bootstrap included.
    grpo = AlgoConfig(adv_estimator="grpo")
    a1, _ = compute_advantages(grpo, rewards, mask, group_size=3, truncated=truncated, last_values=last_values)
    a2, _ = compute_advantages(grpo, rewards, mask, group_size=3)
    np.testing.assert_array_equal(a1, a2)


def test_gae_bootstrap_argument_vs_reference():
    mask = random_multi_turn_masks(5, 12, RNG)
    rewards = (RNG.normal(size=mask.shape) * mask).astype(np.float32)
    values = np.where(mask > 0, RNG.normal(size=mask.shape), 50.0).astype(np.float32)
    boot = RNG.normal(size=5).astype(np.float32)
    fn = jax.jit(lambda r, v, m, b: gae_advantages(r, v, m, gamma=0.9, gae_lambda=0.7, bootstrap_values=b))
    adv, _ = fn(rewards, values, mask, boot)
    np.testing.assert_allclose(adv, np_areal_gae(rewards, values * mask, mask, 0.9, 0.7, bootstrap=boot),
                               rtol=1e-5, atol=1e-5)
