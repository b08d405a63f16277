"""The decoupled PPO loss held against a NumPy reference written here, values and gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.algo import decoupled_ppo_loss

jax.config.update("jax_enable_x64", False)


def _m2po_drops(log_w, mask, threshold):
    """M2PO's drops as the paper states them: drop the largest squared log-weights, one at a time,
    while the mean of those left is not below the threshold and more than one is left."""
    m = mask > 0
    where = np.flatnonzero(m)
    sq = np.square(log_w[where])
    order = where[np.argsort(-sq, kind="stable")]
    drops = np.zeros(len(log_w), bool)
    k = 0
    while k < len(order) - 1 and np.mean(np.square(log_w[order[k:]])) >= threshold:
        drops[order[k]] = True
        k += 1
    return drops


def _reference(lp, prox, behav, adv, mask, segs, *, eps, eps_hi, c_clip, cap, decoupled, level, agg, norm,
               m2=None):
    """Loss, d loss / d logprobs and stats, written from the papers' formulas in NumPy, in AReaL's
    order: M2PO's drops leave the loss mask (and the token mean's count), the cap zeroes the
    weight, and GSPO's sequence ratio and advantage are means over the kept tokens."""
    lp, prox, behav, adv, mask = (np.asarray(x, np.float64).ravel() for x in (lp, prox, behav, adv, mask))
    segs = np.asarray(segs).ravel()
    if not decoupled:
        prox = behav
    eps_hi = eps if eps_hi is None else eps_hi
    n = len(lp)
    m = mask > 0
    w_raw = np.exp(prox - behav) if decoupled else np.ones(n)
    log_w = np.where(m, prox - behav, 0.0) if decoupled else np.zeros(n)
    capped = (w_raw > cap) if cap is not None else np.zeros(n, bool)
    m2_drops = _m2po_drops(log_w, mask, m2) if m2 is not None else np.zeros(n, bool)
    dropped = capped | m2_drops
    in_loss = m & ~m2_drops  # M2PO's drops leave the loss mask; the cap's only zero the weight
    kept = in_loss & ~capped
    w = np.where(dropped, 0.0, w_raw)
    ratio = np.exp(lp - prox)
    dratio = np.diag(ratio)  # d ratio_t / d logprobs_u
    if level == "sequence":  # the sequence's mean log-ratio and mean advantage over its kept tokens
        ratio, adv, dratio = np.empty(n), adv.copy(), np.zeros((n, n))
        for s_ in np.unique(segs):
            sel, ks = segs == s_, (segs == s_) & kept
            cnt = max(ks.sum(), 1)
            ratio[sel] = np.exp((lp - prox)[ks].sum() / cnt)
            adv[sel] = adv[ks].sum() / cnt
            dratio[np.ix_(sel, ks)] = ratio[sel][:, None] / cnt
    unclipped = -adv * ratio
    clipped = -adv * np.clip(ratio, 1 - eps, 1 + eps_hi)
    loss_tok = np.maximum(unclipped, clipped)
    # d L_t / d ratio_t is -A on the unclipped branch and 0 elsewhere.
    dtok = np.where(clipped > unclipped, 0.0, -adv)
    dual = np.zeros(n, bool)
    if c_clip is not None:
        dual = (adv < 0) & (loss_tok > c_clip * np.abs(adv))
        loss_tok = np.where(dual, c_clip * np.abs(adv), loss_tok)
        dtok = np.where(dual, 0.0, dtok)
    coef = np.zeros(n)
    if agg == "token_mean":
        coef[:] = 1.0 / max(in_loss.sum(), 1)
    elif agg == "constant":
        coef[:] = 1.0 / norm
    else:
        live = [s_ for s_ in np.unique(segs) if mask[segs == s_].sum() > 0]
        for s_ in live:
            sel = segs == s_
            coef[sel] = 1.0 / max(in_loss[sel].sum(), 1) / len(live)
    loss = np.sum(np.where(kept, w * loss_tok * coef, 0.0))
    grad = np.where(kept, w * dtok * coef, 0.0) @ dratio
    k = max(mask.sum(), 1)
    stats = {
        "clip_fraction": (m & (clipped > unclipped)).sum() / k,
        "dual_clip_fraction": (m & dual).sum() / k,
        "ratio_mean": ratio[m].sum() / k,
        "behavior_imp_weight_mean": w_raw[m].sum() / k,
        "behavior_imp_weight_max": w_raw[m].max(),
        "dropped_fraction": (m & dropped).sum() / k,
        "m2": np.square(log_w)[m].sum() / k,
        "m2_dropped_fraction": (m & m2_drops).sum() / k,
        "behavior_kl": (w_raw - 1 - np.log(w_raw))[m].sum() / k,
    }
    return loss, grad, stats


def _inputs(seed, shape=(8, 12)):
    rng = np.random.default_rng(seed)
    behav = rng.normal(-1.5, 0.5, shape)
    prox = behav + rng.normal(0, 0.4, shape)
    # A per-sequence drift as well, so that sequence-level (GSPO) ratios also leave the clip range.
    drift = rng.normal(0, 0.3, (shape[0], 1))
    drift[1] = 0.5  # one sequence always far enough ahead for the GSPO dual clip to fire
    lp = prox + rng.normal(0, 0.35, shape) + drift
    adv = rng.normal(0, 1.0, shape)
    mask = (rng.random(shape) > 0.25).astype(np.float32)
    mask[0] = 0.0  # a fully masked sequence must not count in any mean
    return [x.astype(np.float32) for x in (lp, prox, behav, adv, mask)]


# Clip options go together (asymmetric clip with dual clip) to keep the grid small; c_clip is
# low enough that the dual clip really fires on these inputs.
OPTIONS = [
    (i, *combo)
    for i, combo in enumerate(
        itertools.product(
            [True, False],  # use_decoupled
            [(None, None), (0.28, 1.25)],  # (eps_clip_higher, c_clip)
            [None, 1.3],  # behavior_imp_weight_cap
            ["token", "sequence"],
            ["token_mean", "seq_mean_token_mean", "constant"],
        )
    )
]


@pytest.mark.parametrize("seed,decoupled,clips,cap,level,agg", OPTIONS)
def test_loss_and_grad_vs_reference(seed, decoupled, clips, cap, level, agg):
    eps_hi, c_clip = clips
    lp, prox, behav, adv, mask = _inputs(seed)
    segs = np.broadcast_to(np.arange(lp.shape[0])[:, None], lp.shape)
    kw = dict(
        eps_clip=0.2,
        eps_clip_higher=eps_hi,
        c_clip=c_clip,
        behavior_imp_weight_cap=cap,
        use_decoupled=decoupled,
        ratio_level=level,
        aggregation=agg,
        constant_normalizer=64.0 if agg == "constant" else None,
    )
    ref_loss, ref_grad, ref_stats = _reference(
        lp, prox, behav, adv, mask, segs,
        eps=0.2, eps_hi=eps_hi, c_clip=c_clip, cap=cap, decoupled=decoupled, level=level, agg=agg, norm=64.0,
    )  # fmt: skip

    def f(x):
        return decoupled_ppo_loss(x, prox, behav, adv, mask, **kw)

    (loss, stats), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad).ravel(), ref_grad, rtol=1e-4, atol=1e-6)
    for name, value in ref_stats.items():
        np.testing.assert_allclose(stats[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert set(stats) == set(ref_stats)
    # Guard against a vacuous pass: the options under test must actually change something. At
    # sequence level whether a sequence clips hangs on its mean advantage's sign, so the guard
    # there is that the sequence ratio changed the loss.
    if level == "sequence":
        token_loss, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, **{**kw, "ratio_level": "token"})
        assert abs(float(token_loss) - float(loss)) > 1e-3
        return
    assert stats["clip_fraction"] > 0
    if c_clip is not None:
        assert stats["dual_clip_fraction"] > 0
    if cap is not None and decoupled:
        assert stats["dropped_fraction"] > 0


@pytest.mark.parametrize("level,agg,cap", list(itertools.product(
    ["token", "sequence"], ["token_mean", "seq_mean_token_mean", "constant"], [None, 1.3])))
def test_m2po_drops_vs_reference(level, agg, cap):
    lp, prox, behav, adv, mask = _inputs(7)
    segs = np.broadcast_to(np.arange(lp.shape[0])[:, None], lp.shape)
    kw = dict(eps_clip=0.2, behavior_imp_weight_cap=cap, ratio_level=level, aggregation=agg,
              constant_normalizer=64.0 if agg == "constant" else None)
    ref_loss, ref_grad, ref_stats = _reference(
        lp, prox, behav, adv, mask, segs, eps=0.2, eps_hi=None, c_clip=None, cap=cap, decoupled=True,
        level=level, agg=agg, norm=64.0, m2=0.05)

    def f(x):
        return decoupled_ppo_loss(x, prox, behav, adv, mask, m2_threshold=0.05, **kw)

    (loss, stats), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad).ravel(), ref_grad, rtol=1e-4, atol=1e-6)
    for name, value in ref_stats.items():
        np.testing.assert_allclose(stats[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # The inputs' mean square (about 0.16) is well over the threshold: the drop changes the loss.
    assert 0.1 < float(stats["m2_dropped_fraction"]) < 0.9
    plain, _ = decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)
    assert abs(float(plain) - float(loss)) > 1e-3
    # What is kept is under the threshold, and keeping one more token would not be.
    log_w = np.where(mask > 0, prox - behav, 0.0).ravel()
    kept = (mask.ravel() > 0) & ~_m2po_drops(log_w, mask.ravel(), 0.05)
    assert np.mean(np.square(log_w[kept])) < 0.05


def test_m2po_edge_cases():
    from areal_jax.algo.ppo import second_moment_keep

    mask = np.ones(6, np.float32)
    # Ties go by position, so exactly the needed number is dropped: here the first two 1.0s.
    log_w = np.array([0.0, 1.0, 1.0, 1.0, 0.1, 0.0], np.float32)
    keep = np.asarray(second_moment_keep(jnp.asarray(log_w), jnp.asarray(mask), 0.3))
    np.testing.assert_array_equal(keep, ~_m2po_drops(log_w, mask, 0.3))
    assert keep.tolist() == [True, False, False, True, True, True]
    # Nothing over the threshold: nothing dropped; masked tokens are never kept.
    mask[5] = 0
    keep = np.asarray(second_moment_keep(jnp.asarray(log_w), jnp.asarray(mask), 10.0))
    assert keep.tolist() == [True, True, True, True, True, False]
    # Every token over it: the smallest one is kept, as M2PO does, so the loss never goes empty.
    keep = np.asarray(second_moment_keep(jnp.asarray(log_w + 5.0), jnp.asarray(mask), 0.01))
    assert keep.tolist() == [True, False, False, False, False, False]
    # No masked token at all: nothing kept, and no error.
    assert not np.asarray(second_moment_keep(jnp.asarray(log_w), jnp.zeros(6, jnp.float32), 0.01)).any()


def test_m2po_is_refused_where_it_would_do_nothing():
    lp, prox, behav, adv, mask = _inputs(1)
    with pytest.raises(ValueError, match="m2_threshold"):
        decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2, m2_threshold=0.04, use_decoupled=False)
    with pytest.raises(ValueError, match="positive"):
        decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2, m2_threshold=0.0)


def test_packed_1d_with_seq_ids_matches_rows():
    lp, prox, behav, adv, mask = _inputs(7)
    kw = dict(eps_clip=0.2, ratio_level="sequence", aggregation="seq_mean_token_mean", c_clip=3.0)
    rows_loss, rows_stats = decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)
    seq_ids = np.repeat(np.arange(1, lp.shape[0] + 1), lp.shape[1])
    flat = [x.ravel() for x in (lp, prox, behav, adv, mask)]
    packed_loss, packed_stats = jax.jit(lambda *a: decoupled_ppo_loss(*a, seq_ids=seq_ids, **kw))(*flat)
    np.testing.assert_allclose(packed_loss, rows_loss, rtol=1e-6)
    np.testing.assert_allclose(packed_stats["ratio_mean"], rows_stats["ratio_mean"], rtol=1e-6)


def test_1d_sequence_level_without_seq_ids_is_an_error():
    lp, prox, behav, adv, mask = (x.ravel() for x in _inputs(1))
    with pytest.raises(ValueError, match="seq_ids"):
        decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2, ratio_level="sequence")


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_no_gradient_reaches_masked_or_dropped_tokens(level):
    lp, prox, behav, adv, mask = _inputs(3)
    # Make some unmasked tokens far off-policy so the cap drops them.
    behav[1, :4] = prox[1, :4] - 3.0
    mask[1, :4] = 1.0
    # Garbage in padding must not leak into the loss or the gradient.
    lp = np.where(mask > 0, lp, 80.0).astype(np.float32)

    def f(x):
        return decoupled_ppo_loss(
            x, prox, behav, adv, mask, eps_clip=10.0, behavior_imp_weight_cap=5.0, ratio_level=level
        )

    (loss, stats), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
    grad = np.asarray(grad)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    assert np.all(grad[mask == 0] == 0.0)
    assert np.all(grad[1, :4] == 0.0)
    assert stats["dropped_fraction"] == pytest.approx(4 / mask.sum())
    # The rest of the batch still learns: the test is not passing because everything is zero.
    live = (mask > 0) & ~np.isin(np.arange(lp.size).reshape(lp.shape), np.arange(12, 16))
    assert np.count_nonzero(grad[live]) == live.sum()


def test_decoupled_equals_naive_when_proximal_is_behavior():
    lp, _, behav, adv, mask = _inputs(11)
    for agg in ("token_mean", "seq_mean_token_mean"):
        kw = dict(eps_clip=0.2, eps_clip_higher=0.3, c_clip=3.0, aggregation=agg)
        dec, dec_stats = decoupled_ppo_loss(lp, behav, behav, adv, mask, use_decoupled=True, **kw)
        naive, _ = decoupled_ppo_loss(lp, behav + 5.0, behav, adv, mask, use_decoupled=False, **kw)
        np.testing.assert_allclose(dec, naive, rtol=1e-6)
        assert dec_stats["behavior_kl"] == pytest.approx(0.0, abs=1e-7)


def test_all_zero_mask_gives_zero_loss_not_nan():
    lp, prox, behav, adv, mask = _inputs(5)
    for agg in ("token_mean", "seq_mean_token_mean"):
        loss, stats = decoupled_ppo_loss(
            lp, prox, behav, adv, np.zeros_like(mask), eps_clip=0.2, aggregation=agg
        )
        assert float(loss) == 0.0
        assert all(np.isfinite(v) for v in stats.values())


def test_gspo_sequence_ratio_is_shared_by_all_tokens():
    lp, prox, behav, adv, mask = _inputs(9)
    adv = np.repeat(adv[:, :1], lp.shape[1], axis=1)
    # With a huge clip range nothing clips, so the loss is -mean_seq(A_i * s_i).
    loss, _ = decoupled_ppo_loss(
        lp, prox, prox, adv, mask, eps_clip=100.0, ratio_level="sequence", aggregation="seq_mean_token_mean"
    )
    live = range(1, lp.shape[0])
    s = {i: np.exp(((lp - prox)[i] * mask[i]).sum() / mask[i].sum()) for i in live}
    expected = -np.mean([adv[i, 0] * s[i] for i in live])
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


def test_jit_matches_eager_with_every_option_on():
    lp, prox, behav, adv, mask = _inputs(21)
    kw = dict(
        eps_clip=0.2, eps_clip_higher=0.28, c_clip=1.25, behavior_imp_weight_cap=1.3, m2_threshold=0.05,
        ratio_level="sequence", aggregation="constant", constant_normalizer=50.0,
    )  # fmt: skip
    eager = decoupled_ppo_loss(lp, prox, behav, adv, mask, **kw)
    jitted = jax.jit(lambda *a: decoupled_ppo_loss(*a, **kw))(lp, prox, behav, adv, mask)
    np.testing.assert_allclose(jitted[0], eager[0], rtol=1e-6)
    for name in eager[1]:
        np.testing.assert_allclose(jitted[1][name], eager[1][name], rtol=1e-6)
