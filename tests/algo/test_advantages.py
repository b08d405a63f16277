"""Advantage estimators and reward shaping vs NumPy references written here."""

import jax
import numpy as np
import pytest

from areal_jax.algo import (
    AlgoConfig,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    normalize_advantages,
    overlong_penalty,
    rloo_advantages,
    shape_rewards,
    terminal_token_rewards,
)

RNG = np.random.default_rng(0)
REWARDS = RNG.normal(size=(5, 4)).astype(np.float32)
REWARDS[2] = 1.0  # an all-correct group: GRPO must give zeros, not NaN


def _np_grpo(r, eps=1e-5, ddof=1):
    """AReaL's defaults: unbiased (ddof 1) group std, eps 1e-5."""
    out = np.empty_like(r)
    for i, g in enumerate(r):
        out[i] = (g - g.mean()) / (np.sqrt(np.sum((g - g.mean()) ** 2) / (len(g) - ddof)) + eps)
    return out


def _np_rloo(r):
    out = np.empty_like(r)
    for i, g in enumerate(r):
        for j in range(len(g)):
            out[i, j] = g[j] - np.mean(np.delete(g, j))
    return out


@pytest.mark.parametrize(
    "fn,ref",
    [
        (grpo_advantages, _np_grpo),
        (dr_grpo_advantages, lambda r: r - r.mean(axis=1, keepdims=True)),
        (rloo_advantages, _np_rloo),
    ],
)
def test_group_estimators_vs_reference(fn, ref):
    expected = ref(REWARDS.astype(np.float64))
    np.testing.assert_allclose(fn(REWARDS), expected, rtol=1e-5, atol=1e-5)
    flat = fn(REWARDS.reshape(-1), group_size=4)
    np.testing.assert_allclose(flat, expected.reshape(-1), rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(fn(REWARDS))))


def test_grpo_std_is_unbiased_by_default_and_population_on_request():
    np.testing.assert_allclose(grpo_advantages(REWARDS), _np_grpo(REWARDS.astype(np.float64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpo_advantages(REWARDS, unbiased=False, eps=1e-6),
                               _np_grpo(REWARDS.astype(np.float64), eps=1e-6, ddof=0), rtol=1e-5, atol=1e-6)
    # The two differ by sqrt(n / (n - 1)) on a group of 4: the choice is visible.
    ratio = np.asarray(grpo_advantages(REWARDS[:1], unbiased=False, eps=0.0)) / np.asarray(
        grpo_advantages(REWARDS[:1], eps=0.0))
    np.testing.assert_allclose(ratio, np.sqrt(4 / 3), rtol=1e-5)
    # A group of one has no spread: advantage 0, not NaN (AReaL takes its std as 1).
    single = np.asarray(grpo_advantages(np.array([[3.0], [-1.0]], np.float32)))
    np.testing.assert_array_equal(single, [[0.0], [0.0]])


def test_grouping_errors_are_clear():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(REWARDS.reshape(-1))
    with pytest.raises(ValueError, match="groups of 3"):
        grpo_advantages(REWARDS.reshape(-1), group_size=3)
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(REWARDS.reshape(-1, 1))


def _np_gae(rewards, values, mask, gamma, lam):
    adv = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        n = int(mask[b].sum())  # right-padded: the first n tokens are real
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[b, t + 1] if t + 1 < n else 0.0
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            last = delta + gamma * lam * last
            adv[b, t] = last
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_vs_reference_on_right_padded_rows(gamma, lam):
    rng = np.random.default_rng(1)
    lengths = [7, 3, 10, 1]
    mask = np.array([[1.0] * n + [0.0] * (10 - n) for n in lengths], np.float32)
    rewards = (rng.normal(size=(4, 10)) * mask).astype(np.float32)
    # Values in padding are garbage on purpose: they must not bootstrap into real tokens.
    values = np.where(mask > 0, rng.normal(size=(4, 10)), 50.0).astype(np.float32)
    adv, ret = jax.jit(lambda *a: gae_advantages(*a, gamma=gamma, gae_lambda=lam))(rewards, values, mask)
    ref_adv, ref_ret = _np_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
    one_adv, _ = gae_advantages(rewards[0], values[0], mask[0], gamma=gamma, gae_lambda=lam)
    np.testing.assert_allclose(one_adv, ref_adv[0], rtol=1e-5, atol=1e-5)


def test_shape_rewards_order_is_bias_scale_clip():
    r = np.array([-3.0, 0.0, 1.0, 4.0], np.float32)
    np.testing.assert_allclose(shape_rewards(r, scale=2.0, bias=0.5, clip=5.0), [-5.0, 1.0, 3.0, 5.0])
    np.testing.assert_allclose(shape_rewards(r), r)


def test_overlong_penalty_vs_reference():
    lengths = np.arange(0, 130, 3)
    out = overlong_penalty(lengths, max_len=100, buffer_len=20, penalty_factor=0.5)
    ref = [0.0 if n <= 80 else (-0.5 if n > 100 else (80 - n) / 20 * 0.5) for n in lengths]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-7)
    assert float(overlong_penalty(np.array([100]), max_len=100, buffer_len=20, penalty_factor=0.5)[0]) == -0.5


def test_normalize_advantages_uses_masked_tokens_only():
    rng = np.random.default_rng(2)
    adv = rng.normal(3.0, 2.0, (3, 8)).astype(np.float32)
    mask = (rng.random((3, 8)) > 0.4).astype(np.float32)
    adv_padded = np.where(mask > 0, adv, 1e4).astype(np.float32)
    out = np.asarray(normalize_advantages(adv_padded, mask))
    live = adv[mask > 0]
    np.testing.assert_allclose(
        out[mask > 0], (live - live.mean()) / (live.std(ddof=1) + 1e-5), rtol=1e-4, atol=1e-5
    )
    assert np.all(out[mask == 0] == 0.0)
    biased = np.asarray(normalize_advantages(adv_padded, mask, 1e-6, unbiased=False))
    np.testing.assert_allclose(biased[mask > 0], (live - live.mean()) / (live.std() + 1e-6), rtol=1e-4, atol=1e-5)


def test_terminal_token_rewards_puts_reward_on_last_real_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)
    out = np.asarray(terminal_token_rewards(np.array([2.0, -1.0, 5.0]), mask))
    np.testing.assert_array_equal(out, [[0, 0, 2, 0], [-1, 0, 0, 0], [0, 0, 0, 0]])


def _np_run_group_scores(name, rewards, groups, runs, discounts=None, eps=1e-5):
    """Plain-Python reference: per group, the runs' rewards (each run's last trajectory's) once;
    every trajectory gets its run's score, the baseline discounted like its reward."""
    w = np.ones(len(rewards)) if discounts is None else np.asarray(discounts)
    out = np.zeros(len(rewards))
    for g in set(groups):
        members = [i for i in range(len(rewards)) if groups[i] == g]
        run_reward = {}
        for i in members:
            run_reward[runs[i]] = rewards[i]  # the last in order wins
        rr = np.array(list(run_reward.values()), np.float64)
        n = len(rr)
        for i in members:
            if name == "grpo":
                std = rr.std(ddof=1) if n > 1 else 1.0
                out[i] = (rewards[i] - w[i] * rr.mean()) / (std + eps)
            elif name == "dr_grpo":
                out[i] = rewards[i] - w[i] * rr.mean()
            else:  # rloo
                out[i] = rewards[i] - w[i] * (rr.sum() - run_reward[runs[i]]) / (n - 1) if n > 1 else 0.0
    return out


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_run_grouped_scores_count_each_run_once(name):
    from areal_jax.algo.advantages import dense_run_ids, run_group_scores

    # group 7: run 0 made three calls (turn rewards discounted 0.25, 0.5, 1), run 1 one call
    # (0), run 2 two calls (0.5, 1); group 3: two runs of one call each; group 9: one run of two.
    groups = [7, 7, 7, 7, 7, 7, 3, 3, 9, 9]
    runs = [0, 0, 0, 1, 2, 2, 0, 1, 0, 0]
    rewards = [0.25, 0.5, 1.0, 0.0, 0.5, 1.0, 1.0, 0.0, 0.3, 0.6]
    w = [0.25, 0.5, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.5, 1.0]
    g, r = dense_run_ids(groups, runs)
    got = np.asarray(run_group_scores(name, np.array(rewards, np.float32), np.array(g), np.array(r),
                                      np.array(w, np.float32)))
    np.testing.assert_allclose(got, _np_run_group_scores(name, rewards, g, r, w), rtol=1e-5, atol=1e-6)
    if name == "grpo":
        # run statistics [1, 0, 1]: mean 2/3, std sqrt(1/3); each turn its run's score, discounted
        np.testing.assert_allclose(got[:3], np.array(w[:3]) * (1 - 2 / 3) / (np.sqrt(1 / 3) + 1e-5), rtol=1e-5)
        # a group whose runs all earned 0.6: every turn scores 0, the discounted one included
        np.testing.assert_allclose(got[8:], 0.0, atol=1e-6)


def test_run_grouped_scores_with_one_trajectory_per_run_are_the_plain_estimators():
    from areal_jax.algo.advantages import dense_run_ids, run_group_scores

    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], np.float32)
    g, r = dense_run_ids([0, 0, 0, 1, 1, 1], list(range(6)))
    for name, fn in [("grpo", grpo_advantages), ("dr_grpo", dr_grpo_advantages), ("rloo", rloo_advantages)]:
        np.testing.assert_allclose(run_group_scores(name, rewards, np.array(g), np.array(r)), fn(rewards, 3),
                                   rtol=1e-5, atol=1e-6)
    assert dense_run_ids([0, 0, 1], [-1, -1, -1]) is None  # no runs named: the even-group path


def test_compute_advantages_takes_uneven_groups_of_runs():
    """``per_turn`` agent trajectories under GRPO: before, the trainer stopped with "groups must
    all have the same size"; now each turn gets its run-normalised score on every masked token."""
    from areal_jax.algo.advantages import dense_run_ids

    rewards = [0.5, 1.0, 0.0, 1.0, 0.0]  # group 0: run 0 (two turns), run 1; group 1: runs of one
    w = [0.5, 1.0, 1.0, 1.0, 1.0]
    g, r = dense_run_ids([0, 0, 0, 1, 1], [0, 0, 1, 0, 1])
    mask = np.array([[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0]], np.float32)
    adv, _ = compute_advantages(AlgoConfig(), np.array(rewards, np.float32), mask,
                                group_ids=np.array(g), run_ids=np.array(r), discounts=np.array(w, np.float32))
    scores = _np_run_group_scores("grpo", rewards, g, r, w)
    np.testing.assert_allclose(np.asarray(adv), scores[:, None] * mask, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="need group_ids"):
        compute_advantages(AlgoConfig(), np.array(rewards, np.float32), mask, run_ids=np.array(r))
def _np_sequence_gae(r, v, m, gamma, lam, boot):
    """One sequence: the recursion over its masked tokens only, from ``boot`` after the last."""
    adv, next_v, next_a = np.zeros_like(r), boot, 0.0
    for t in reversed(range(len(r))):
        if m[t] > 0:
            next_a = r[t] + gamma * next_v - v[t] + gamma * lam * next_a
            adv[t], next_v = next_a, v[t]
    return adv


def test_packed_segments_equal_each_sequence_alone():
    """Packed rows (``segments``: sequences side by side, then padding): the terminal reward
    lands on each sequence's last masked token and GAE restarts at each sequence's end from its
    own bootstrap, as if each sequence were alone (NumPy, one sequence at a time). Masks have
    gaps (multi-turn), padding values are garbage."""
    rng = np.random.default_rng(3)
    lengths, rows = [5, 4, 6, 3], [[0, 1], [2, 3]]
    masks = [np.array([0, 1, 0, 1, 1]), np.array([0, 0, 1, 1]), np.array([0, 1, 1, 0, 1, 0]), np.array([0, 1, 1])]
    seq_rewards = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    boot = np.array([0.7, 0.0, -0.4, 0.2], np.float32)
    values = [rng.normal(size=n).astype(np.float32) for n in lengths]
    kl = [rng.normal(size=n).astype(np.float32) for n in lengths]
    width = 12
    mask, segments = np.zeros((2, width), np.float32), np.full((2, width), -1, np.int32)
    vals, tok = np.full((2, width), 50.0, np.float32), np.zeros((2, width), np.float32)
    place = {}
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            sl = slice(start, start + lengths[s])
            mask[r, sl], segments[r, sl], vals[r, sl], tok[r, sl] = masks[s], s, values[s], kl[s]
            place[s] = (r, sl)
            start += lengths[s]
    terminal = np.asarray(terminal_token_rewards(seq_rewards, mask, segments))
    token_rewards = terminal + tok * mask
    gamma, lam = 0.9, 0.8
    adv, ret = jax.jit(lambda r, v, m, b, s: gae_advantages(r, v, m, gamma=gamma, gae_lambda=lam,
                                                             bootstrap_values=b, segments=s))(
        token_rewards, vals, mask, boot, segments)
    for s, (r, sl) in place.items():
        want_terminal = np.zeros(lengths[s], np.float32)
        want_terminal[np.flatnonzero(masks[s])[-1]] = seq_rewards[s]
        np.testing.assert_array_equal(terminal[r, sl], want_terminal)
        want = _np_sequence_gae(want_terminal + kl[s] * masks[s], values[s] * masks[s], masks[s], gamma, lam, boot[s])
        np.testing.assert_allclose(adv[r, sl], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[r, sl], (want + values[s]) * masks[s], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(adv)[segments < 0] == 0) and np.all(terminal[segments < 0] == 0)
