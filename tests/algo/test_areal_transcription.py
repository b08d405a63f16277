"""Our loss and advantage pipeline against NumPy transcriptions of AReaL's, loss and gradient.

Each ``areal_*`` function below is written here from reading AReaL's source at commit
4aef98d8d818af55b43621aaadba047ae10f4e77 (inclusionAI/AReaL, 2026-05-21); its docstring names the
file and function it follows. They keep AReaL's layout (right-padded ``[batch, tokens]`` rows,
the loss mask and logprobs rolled one position left before the loss) and PyTorch's autograd
conventions, which the gradients here are derived by hand from: ``torch.clamp`` passes the
gradient at a value on a bound, ``torch.max`` / ``torch.min`` of two tensors split it evenly
where they are equal. The recipes each preset must reproduce are transcribed from
``examples/math/gsm8k_*.yaml`` (``AREAL_RECIPES``).

Where we deliberately differ, a test says so by name: the ``loglinear`` proximal estimate's
version convention (``test_loglinear_version_convention_differs_from_areal_by_one_step``).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.algo import (
    AlgoConfig,
    OverlongPenalty,
    approx_proximal_logprobs,
    compute_advantages,
    decoupled_ppo_loss,
    ppo_loss_kwargs,
)
from areal_jax.algo.kl import kl_penalty_estimate
from areal_jax.config import from_dict, read_config_file
from tests.algo.test_config import PRESETS

GROUP = 4

# ---------------------------------------------------------------------------------------------
# Transcriptions
# ---------------------------------------------------------------------------------------------


def areal_m2po_loss_mask(old_logp, prox_logp, loss_mask, m2_threshold):
    """``areal/trainer/ppo/actor.py``: ``_apply_m2po_masking`` and ``_get_m2po_loss_mask``. The
    masked tokens' squared log ratios sorted largest first; the first suffix whose mean is under
    the threshold is kept (all but one dropped when none is)."""
    m2 = np.square(old_logp - prox_logp)
    flat = loss_mask.reshape(-1).astype(bool)
    selected = m2.reshape(-1)[flat]
    if selected.size == 0:
        return loss_mask.astype(bool)
    order = np.argsort(-selected, kind="stable")
    srt = selected[order]
    suffix_mean = np.cumsum(srt[::-1])[::-1] / np.arange(len(srt), 0, -1)
    below = np.flatnonzero(suffix_mean < m2_threshold)
    n_mask = below[0] if len(below) else len(srt) - 1
    keep_sorted = np.ones(len(srt), bool)
    keep_sorted[:n_mask] = False
    keep = np.empty(len(srt), bool)
    keep[order] = keep_sorted
    out = np.zeros(flat.shape, bool)
    out[flat] = keep
    return out.reshape(loss_mask.shape)


def areal_ppo_actor_loss_fn(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                            eps_clip_higher=None, c_clip=None, rs_upper=None, importance_sampling_level="token"):
    """``areal/utils/functional/functional.py``: ``ppo_actor_loss_fn`` on 2-D padded input, with
    ``rejection_sampling`` as the recipes set it (``metric: ratio``, token level, action
    ``mask``, ``upper: rs_upper``; ``apply_rejection_sampling``) and
    ``_compute_sequence_level_ratio_and_advantages`` for ``importance_sampling_level:
    sequence``. Returns ``(loss, d loss / d logprobs)``."""
    mask = loss_mask.astype(bool)
    count = max(int(mask.sum()), 1)  # counted before rejection sampling changes the mask
    shape, n = logprobs.shape, logprobs.size
    if rs_upper is not None:
        log_w = proximal_logprobs - old_logprobs
        log_w = np.where(np.isfinite(log_w), log_w, 0.0)
        w = np.exp(log_w)
        mask = mask & (w <= rs_upper)
        w = np.where(mask, w, 0.0)
    adv = advantages.astype(np.float64)
    # d ratio[t] / d logprobs[u], flattened
    if importance_sampling_level == "sequence":
        per_seq = np.maximum(mask.sum(1), 1)
        seq_log = np.where(mask, logprobs - proximal_logprobs, 0.0).sum(1) / per_seq
        ratio = np.where(mask, np.exp(seq_log)[:, None], 0.0)
        adv = np.where(mask, (np.where(mask, adv, 0.0).sum(1) / per_seq)[:, None], 0.0)
        dratio = np.zeros((n, n))
        for b in range(shape[0]):
            rows = np.flatnonzero(mask[b]) + b * shape[1]
            dratio[np.ix_(rows, rows)] = ratio[b, mask[b]][:, None] / per_seq[b]
    else:
        ratio = np.where(mask, np.exp(logprobs - proximal_logprobs), 0.0)
        dratio = np.diag(ratio.reshape(-1))
    low, high = 1.0 - eps_clip, 1.0 + (eps_clip if eps_clip_higher is None else eps_clip_higher)
    l1, l2 = -adv * ratio, -adv * np.clip(ratio, low, high)
    d1, d2 = -adv, -adv * ((ratio >= low) & (ratio <= high))
    pg = np.maximum(l1, l2)
    dpg = np.where(l1 > l2, d1, np.where(l1 < l2, d2, 0.5 * (d1 + d2)))
    if c_clip is not None:
        l3 = np.sign(adv) * c_clip * adv
        dpg = np.where(pg < l3, dpg, np.where(pg > l3, 0.0, 0.5 * dpg))
        pg = np.minimum(pg, l3)
    if rs_upper is not None:
        pg, dpg = pg * w, dpg * w
    loss = np.where(mask, pg, 0.0).sum() / count
    grad = (np.where(mask, dpg, 0.0).reshape(-1) / count) @ dratio
    return loss, grad.reshape(shape)


def areal_grpo_loss_fn(logprobs, old_logp, prox_logp, advantages, loss_mask, *, m2_threshold=None, **kw):
    """``areal/trainer/ppo/actor.py``: ``grpo_loss_fn``: M2PO's mask first (when set), then
    ``ppo_actor_loss_fn`` on the masked tokens."""
    if m2_threshold is not None:
        loss_mask = areal_m2po_loss_mask(old_logp, prox_logp, loss_mask, m2_threshold)
    return areal_ppo_actor_loss_fn(logprobs, prox_logp, old_logp, advantages, loss_mask=loss_mask, **kw)


def areal_train_batch(micro_batches, **kw):
    """``areal/engine/fsdp_engine.py``: ``train_batch`` with ``loss_weight_fn`` the micro-batch's
    loss-mask count (``PPOActor._ppo_update``): each micro-batch's loss scaled by its share of
    the minibatch's count, taken before M2PO or rejection sampling touch the mask."""
    total = sum(int(mb[-1].sum()) for mb in micro_batches)
    loss, grads = 0.0, []
    for mb in micro_batches:
        lo, g = areal_grpo_loss_fn(*mb, **kw)
        loss += lo * mb[-1].sum() / total
        grads.append(g * mb[-1].sum() / total)
    return loss, np.concatenate(grads)


def areal_loglinear(old_logp, logprobs, versions, current_version):
    """``areal/trainer/ppo/actor.py``: ``compute_prox_logp_approximations``, method ``loglinear``:
    proximal version ``current_version - 1``, theta ``current_version``."""
    v_prox, v_theta, v_behave = current_version - 1, float(current_version), versions.astype(np.float64)
    diff, gap = v_theta - v_behave, v_prox - v_behave
    ok = (diff > 0) & (versions >= 0)
    alpha = np.clip(np.where(ok, gap / np.where(ok, diff, 1.0), 0.0), 0.0, 1.0)
    return old_logp + alpha * (logprobs - old_logp)


def areal_normalization(x, mask, *, mean_level, std_level, group_size=GROUP, mean_leave1out=False,
                        std_unbiased=True, eps=1e-5):
    """``areal/utils/data.py``: ``Normalization.__call__`` (with ``_compute_mean`` and
    ``_compute_std``), one process, in float64. ``group`` levels take consecutive rows."""
    x = x.astype(np.float64)
    m = np.ones_like(x) if mask is None else mask.astype(np.float64)
    if mask is not None and m.sum() == 0:
        return x

    def mean_of(xx, mm):
        factor, total = mm.sum(), (xx * mm).sum()
        if mean_leave1out:
            if factor <= 1:
                return np.zeros_like(xx)
            return np.where(mm > 0, (total - xx * mm) / np.maximum(factor - mm, 1.0), total / factor)
        return np.full_like(xx, total / factor if factor else 0.0)

    def std_of(xx, mm, mean):
        factor, sq = mm.sum(), np.square(xx * mm - mean * mm).sum()
        if std_unbiased:
            return np.full_like(xx, 1.0 if factor <= 1 else np.sqrt(sq / (factor - 1)))
        return np.full_like(xx, np.sqrt(sq / factor) if factor else 1.0)

    def groups():
        return [slice(i, i + group_size) for i in range(0, x.shape[0] - group_size + 1, group_size)]

    mean = np.zeros_like(x)
    if mean_level == "batch":
        mean = mean_of(x, m)
    elif mean_level == "group":
        for s in groups():
            mean[s] = mean_of(x[s], m[s])
    centred = (x - mean) * (1.0 if mask is None else m)
    if std_level is None:
        return centred  # std 1 and eps 0
    std = np.zeros_like(x)
    if std_level == "batch":
        std = std_of(x, m, mean)
    else:
        for s in groups():
            std[s] = std_of(x[s], m[s], mean[s])
    return centred / (std + eps)


def areal_kl(log_probs, log_probs_base, estimator):
    """``areal/utils/data.py``: ``KLEstimator._compute_approx_kl`` with ``apply_clamp=True``."""
    d = log_probs - log_probs_base
    out = {"k1": d, "k2": d**2 / 2.0, "k3": np.exp(-d) - 1 + d}[estimator]
    return np.clip(out, -10, 10)


def areal_compute_advantages(data, actor):
    """``areal/trainer/ppo/actor.py``: ``PPOActor._compute_advantages`` (with
    ``reward_overlong_penalty`` from ``areal/utils/functional/functional.py``), decoupled loss:
    the behaviour logprobs are rolled, the loss mask is rolled, the reward goes to the position
    of the last token, GAE skips masked positions, then ``adv_norm``. ``data`` holds
    ``attention_mask``, ``loss_mask`` and ``logprobs`` unrolled, ``rewards`` ``[batch]``,
    optionally ``ref_logp`` and ``values`` (both already in rolled positions, as AReaL's engines
    return them). Returns ``(advantages, rolled loss mask)``."""
    bs, width = data["attention_mask"].shape
    rewards = data["rewards"].astype(np.float64).copy()
    if actor.get("overlong") is not None:
        tokens, factor, max_new = actor["overlong"]
        lengths = data["loss_mask"].sum(-1)
        rewards += np.minimum(-(lengths - (max_new - tokens)) / tokens * factor, 0.0)
    score = np.clip((rewards + actor["reward_bias"]) * actor["reward_scaling"], -actor["reward_clip"],
                    actor["reward_clip"])
    if actor.get("reward_norm") is not None:
        score = areal_normalization(score, None, **actor["reward_norm"])
    loss_mask = np.roll(data["loss_mask"].astype(np.float64), -1, axis=-1)
    old_logp = np.roll(data["logprobs"], -1, axis=-1) * loss_mask
    ref_logp = data.get("ref_logp", np.zeros_like(old_logp)) * loss_mask
    seqlens = data["attention_mask"].sum(-1).astype(int)
    no_eos = seqlens == width
    tok_rewards = -actor["kl_ctl"] * areal_kl(old_logp, ref_logp, actor["kl_estimator"])
    rows = np.arange(bs)
    tok_rewards[rows, seqlens - 1] = 0
    last = np.clip(seqlens - 2, 0, None)
    tok_rewards[rows, last] += np.where(no_eos, 0.0, score) if actor.get("mask_no_eos_with_zero") else score
    values = data.get("values", np.zeros_like(tok_rewards))
    adv = np.zeros((bs, width))
    lastgaelam = np.zeros(bs)
    nextvalues = values[:, width - 1] * no_eos
    for t in reversed(range(width - 1)):
        delta = tok_rewards[:, t] + actor["discount"] * nextvalues - values[:, t]
        new = delta + actor["discount"] * actor["gae_lambda"] * lastgaelam
        m = loss_mask[:, t]
        nextvalues = nextvalues * (1 - m) + values[:, t] * m
        lastgaelam = lastgaelam * (1 - m) + new * m
        adv[:, t] = lastgaelam
    if actor.get("adv_norm") is not None:
        adv = areal_normalization(adv, loss_mask, **actor["adv_norm"])
    return adv, loss_mask


# ---------------------------------------------------------------------------------------------
# The recipes (examples/math/gsm8k_*.yaml, actor section) and the presets that must match them
# ---------------------------------------------------------------------------------------------

AREAL_GRPO = dict(
    eps_clip=0.4, eps_clip_higher=None, c_clip=None, m2_threshold=None, importance_sampling_level="token",
    rs_upper=5.0, reward_scaling=10.0, reward_bias=-0.5, reward_clip=20.0, kl_ctl=0.0, kl_estimator="k1",
    discount=1.0, gae_lambda=1.0, overlong=None, mask_no_eos_with_zero=False,
    reward_norm=dict(mean_level="group", std_level="group"),
    adv_norm=dict(mean_level="batch", std_level="batch"),
)  # fmt: skip
AREAL_RECIPES = {
    "grpo": {},  # gsm8k_grpo.yaml
    "gspo": {"importance_sampling_level": "sequence"},  # gsm8k_gspo.yaml
    "m2po": {"eps_clip": 0.0, "m2_threshold": 0.04},  # gsm8k_m2po.yaml
    # gsm8k_dapo_dynamic_bs.yaml (overlong_tokens 512 and max_new_tokens 4096 there; scaled here
    # to this batch's lengths, on both sides)
    "dapo": {"eps_clip": 0.2, "eps_clip_higher": 0.28, "overlong": (8, 1.0, 22)},
    "dr_grpo": {"reward_norm": dict(mean_level="group", std_level=None)},  # gsm8k_drgrpo.yaml
    "rloo": {"reward_norm": dict(mean_level="group", mean_leave1out=True, std_level=None)},  # gsm8k_rloo.yaml
    "reinforce_pp": {"reward_norm": None, "kl_ctl": 0.001, "kl_estimator": "k1"},  # gsm8k_reinforce.yaml
    "ppo": {"reward_norm": None},  # gsm8k_ppo.yaml (and a critic)
}


def preset(name: str) -> AlgoConfig:
    cfg = from_dict(AlgoConfig, read_config_file(PRESETS / f"{name}.yaml")["algo"])
    if cfg.overlong_penalty is not None:  # the run config's job: max_len from rollout.max_new_tokens
        tokens, factor, max_new = AREAL_RECIPES[name]["overlong"]
        cfg = dataclasses.replace(cfg, overlong_penalty=OverlongPenalty(buffer_len=tokens, penalty_factor=factor,
                                                                        max_len=max_new))
    return cfg


def random_batch(rng, *, rows=8, width=24, stale=0.3):
    """AReaL's layout: right-padded rows of prompt then answer; two of them fill the width (no
    EOS: cut at the length limit). Logprobs unrolled (index ``i`` holds token ``i``'s)."""
    attn = np.zeros((rows, width), np.int64)
    lmask = np.zeros((rows, width), np.float64)
    for b in range(rows):
        prompt = int(rng.integers(2, 5))
        total = width if b in (1, 6) else int(rng.integers(prompt + 3, width))
        attn[b, :total] = 1
        lmask[b, prompt:total] = 1
    behav = np.where(attn > 0, rng.normal(-1.2, 0.6, (rows, width)), 0.0)
    ref = behav + rng.normal(0, 0.3, (rows, width))
    ref[3, attn[3].sum() - 2] -= 40.0  # one token far under the reference: the KL clamp binds
    prox = behav + rng.normal(0, stale, (rows, width))
    theta = prox + rng.normal(0, 0.25, (rows, width))
    rewards = rng.integers(0, 2, rows).astype(np.float64)
    rewards[:GROUP] = [1, 0, 0, 1]
    values = rng.normal(0, 1, (rows, width))
    return dict(attention_mask=attn, loss_mask=lmask, logprobs=behav, ref_logp=ref, rewards=rewards,
                values=values, prox=prox, theta=theta)


def areal_data(batch):
    """The batch as AReaL's actor holds it: the reference engine's logprobs come rolled (position
    ``t`` scores token ``t + 1``), as do the critic's values (``random_batch`` makes them so)."""
    return {**batch, "ref_logp": np.roll(batch["ref_logp"], -1, axis=-1)}


def ours_advantages(cfg: AlgoConfig, batch) -> np.ndarray:
    """Our pipeline as ``trainer/prepare.py`` drives it (index-``i`` convention), rolled into
    AReaL's positions for comparison."""
    mask = batch["loss_mask"]
    kl = np.asarray(kl_penalty_estimate(cfg.kl_estimator, batch["logprobs"], batch["ref_logp"])) * mask
    width = mask.shape[1]
    truncated = batch["attention_mask"].sum(-1) == width
    kw = {}
    if cfg.adv_estimator == "gae":  # the critic's value before token i sits at AReaL's position i - 1
        kw = dict(values=np.roll(batch["values"], 1, axis=-1) * mask, last_values=batch["values"][:, width - 1])
    adv, _ = compute_advantages(cfg, batch["rewards"], mask, group_size=GROUP, token_kl=kl, truncated=truncated,
                                **kw)
    return np.roll(np.asarray(adv, np.float64), -1, axis=-1)


def ours_loss_and_grad(cfg: AlgoConfig, micro_batches):
    """Our loss over micro-batches, each scaled by its share of the loss-mask count, as
    ``Trainer.minibatch_grads`` does; the gradient with respect to the logprobs."""
    total = sum(float(mb[-1].sum()) for mb in micro_batches)
    kw = ppo_loss_kwargs(cfg)

    def loss(thetas):
        return sum(decoupled_ppo_loss(th, prox, behav, adv, mask, **kw)[0] * float(mask.sum()) / total
                   for th, (_, behav, prox, adv, mask) in zip(thetas, micro_batches, strict=True))

    thetas = [jnp.asarray(mb[0], jnp.float32) for mb in micro_batches]
    value, grads = jax.value_and_grad(loss)(thetas)
    return float(value), np.concatenate([np.asarray(g) for g in grads])


def areal_loss_kwargs(actor):
    return {k: actor[k] for k in ("eps_clip", "eps_clip_higher", "c_clip", "m2_threshold", "rs_upper",
                                  "importance_sampling_level")}


def split_micro(theta, behav, prox, adv, mask, rows=4):
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # noqa: E731  both sides see float32 inputs
    return [tuple(f32(x[i:i + rows]) for x in (theta, behav, prox, adv, mask)) for i in range(0, len(mask), rows)]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_every_preset_has_its_areal_recipe():
    assert {p.stem for p in PRESETS.glob("*.yaml")} == set(AREAL_RECIPES)


@pytest.mark.parametrize("name", sorted(AREAL_RECIPES))
def test_preset_vs_areal_recipe(name):
    """Advantages, loss and gradient of the preset on a random batch of two groups (in two
    micro-batches, stale behaviour logprobs) against AReaL's pipeline with the recipe's keys.
    The proximal logprobs are the current ones, as with AReaL's ``ppo_n_minibatches: 1``."""
    actor = {**AREAL_GRPO, **AREAL_RECIPES[name]}
    cfg = preset(name)
    batch = random_batch(np.random.default_rng(sorted(AREAL_RECIPES).index(name)))
    if cfg.adv_estimator != "gae":
        del batch["values"]  # no critic
    adv_areal, mask_r = areal_compute_advantages(areal_data(batch), actor)
    adv_ours = ours_advantages(cfg, batch)
    live = mask_r > 0
    np.testing.assert_allclose(adv_ours[live], adv_areal[live], rtol=2e-4, atol=2e-5)

    roll = lambda x: np.roll(x, -1, axis=-1) * mask_r  # noqa: E731  AReaL's positions: token i + 1 at i
    theta, behav = roll(batch["theta"]), roll(batch["logprobs"])
    micro = split_micro(theta, behav, theta, adv_areal, mask_r)
    loss_a, grad_a = areal_train_batch(micro, **areal_loss_kwargs(actor))
    loss_o, grad_o = ours_loss_and_grad(cfg, split_micro(theta, behav, theta, adv_ours, mask_r))
    np.testing.assert_allclose(loss_o, loss_a, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad_o, grad_a, rtol=2e-4, atol=1e-6)
    assert np.abs(grad_a).max() > 1e-3


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("m2,rs,clips", [
    (None, None, (0.2, None, None)),
    (None, 1.5, (0.2, 0.28, 1.5)),
    (0.04, 5.0, (0.2, None, None)),
    (0.04, None, (0.0, None, None)),
    (0.04, 1.5, (0.2, 0.28, 3.0)),
])  # fmt: skip
def test_grpo_loss_fn_vs_transcription(level, m2, rs, clips):
    """``grpo_loss_fn`` (M2PO's mask, then ``ppo_actor_loss_fn`` with the behaviour weight and its
    cap, the dual clip, GSPO) with proximal logprobs away from both the behaviour and the
    current ones, over two micro-batches: loss and gradient."""
    eps, eps_hi, c_clip = clips
    rng = np.random.default_rng(zlib.crc32(repr((level, m2, rs, clips)).encode()))
    batch = random_batch(rng, stale=0.4)
    mask = batch["loss_mask"]
    adv = rng.normal(0, 1, mask.shape) * mask
    micro = split_micro(batch["theta"], batch["logprobs"], batch["prox"], adv, mask)
    loss_a, grad_a = areal_train_batch(micro, eps_clip=eps, eps_clip_higher=eps_hi, c_clip=c_clip, m2_threshold=m2,
                                       rs_upper=rs, importance_sampling_level=level)
    cfg = AlgoConfig(eps_clip=eps, eps_clip_higher=eps_hi, c_clip=c_clip, m2_threshold=m2, ratio_level=level,
                     use_behavior_imp_weight=rs is not None, behavior_imp_weight_cap=rs, ppo_n_minibatches=2)
    loss_o, grad_o = ours_loss_and_grad(cfg, micro)
    np.testing.assert_allclose(loss_o, loss_a, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad_o, grad_a, rtol=2e-4, atol=1e-6)
    if m2 is not None:  # the filter bit, so its count mattered
        kept = sum(areal_m2po_loss_mask(b, p, mk, m2).sum() for _, b, p, _, mk in micro)
        assert kept < mask.sum()


def test_m2po_averages_over_the_kept_tokens():
    """The review's case: with part of a micro-batch's tokens filtered, AReaL's loss is the mean
    over the kept ones; the mean over all of them scaled the loss and gradient by kept / all."""
    rng = np.random.default_rng(42)
    batch = random_batch(rng, rows=4, stale=0.3)
    mask = batch["loss_mask"]
    adv = rng.normal(0, 1, mask.shape) * mask
    micro = split_micro(batch["theta"], batch["logprobs"], batch["prox"], adv, mask)
    kept = areal_m2po_loss_mask(micro[0][1], micro[0][2], micro[0][4], 0.04).sum()
    assert 0.3 < kept / mask.sum() < 0.9
    cfg = AlgoConfig(m2_threshold=0.04, behavior_imp_weight_cap=None, use_behavior_imp_weight=False,
                     ppo_n_minibatches=2)
    loss_o, grad_o = ours_loss_and_grad(cfg, micro)
    loss_a, grad_a = areal_train_batch(micro, eps_clip=0.2, m2_threshold=0.04)
    np.testing.assert_allclose(loss_o, loss_a, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad_o, grad_a, rtol=2e-4, atol=1e-6)
    assert abs(loss_a * kept / mask.sum() - loss_o) > 1e-3


def test_behaviour_weight_off_is_areal_without_rejection_sampling():
    rng = np.random.default_rng(3)
    batch = random_batch(rng, stale=0.5)
    mask = batch["loss_mask"]
    adv = rng.normal(0, 1, mask.shape) * mask
    micro = split_micro(batch["theta"], batch["logprobs"], batch["prox"], adv, mask)
    off = AlgoConfig(use_behavior_imp_weight=False, behavior_imp_weight_cap=None, ppo_n_minibatches=2)
    loss_o, grad_o = ours_loss_and_grad(off, micro)
    loss_a, grad_a = areal_train_batch(micro, eps_clip=0.2)
    np.testing.assert_allclose(loss_o, loss_a, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(grad_o, grad_a, rtol=2e-4, atol=1e-6)
    on, _ = ours_loss_and_grad(dataclasses.replace(off, use_behavior_imp_weight=True), micro)
    assert abs(on - loss_o) > 1e-3


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("no_eos_zero", [False, True])
def test_reward_chain_vs_transcription(estimator, no_eos_zero):
    """``_compute_advantages`` with every reward option on: overlong penalty on the loss-mask
    count, bias, scale and clip, the group normalisation, a clamped KL reward, answers without
    EOS scored 0, GAE over the mask, the batch normalisation."""
    batch = random_batch(np.random.default_rng(11))
    del batch["values"]
    batch["rewards"] = batch["rewards"] * 3.0  # (3 - 0.5) * 10 = 25: the clip at 20 binds
    actor = {**AREAL_GRPO, "kl_ctl": 0.05, "kl_estimator": estimator, "overlong": (6, 0.7, 22),
             "mask_no_eos_with_zero": no_eos_zero, "discount": 0.97, "gae_lambda": 0.9}
    cfg = AlgoConfig(reward_scale=10.0, reward_bias=-0.5, reward_clip=20.0, adv_norm=True, kl_coef=0.05,
                     kl_estimator=estimator, mask_no_eos_with_zero=no_eos_zero, gamma=0.97, gae_lambda=0.9,
                     overlong_penalty=OverlongPenalty(buffer_len=6, penalty_factor=0.7, max_len=22))
    adv_a, mask_r = areal_compute_advantages(areal_data(batch), actor)
    adv_o = ours_advantages(cfg, batch)
    np.testing.assert_allclose(adv_o[mask_r > 0], adv_a[mask_r > 0], rtol=2e-4, atol=2e-5)
    # Neither option is idle on this batch.
    flipped = ours_advantages(dataclasses.replace(cfg, mask_no_eos_with_zero=not no_eos_zero), batch)
    assert np.abs(flipped - adv_o).max() > 1e-2
    kl = areal_kl(np.roll(batch["logprobs"], -1, -1), np.roll(batch["ref_logp"], -1, -1), estimator)
    assert np.abs(kl[mask_r > 0]).max() == 10.0  # the clamp binds on one token


def test_loglinear_matches_areal_one_version_later():
    """Our estimate at ``proximal_version = p`` is AReaL's at ``current_version = p + 1``."""
    rng = np.random.default_rng(5)
    n = 64
    behav = rng.normal(-2, 0.5, n)
    theta = behav + rng.normal(0, 0.3, n)
    versions = rng.integers(-1, 9, n)
    for p in (3, 6, 8):
        ours = np.asarray(approx_proximal_logprobs(behav.astype(np.float32), theta.astype(np.float32),
                                                   versions, p))
        np.testing.assert_allclose(ours, areal_loglinear(behav, theta, versions, p + 1), rtol=1e-5, atol=1e-6)


def test_loglinear_version_convention_differs_from_areal_by_one_step():
    """Deliberate difference. At trainer version ``g`` AReaL passes ``current_version = g`` and
    puts the proximal policy at ``g - 1``, though the proximal policy it recomputes holds the
    weights of version ``g``. Our proximal version is ``g``: a token of staleness 1 gets alpha
    1/2 here and 0 there (``kl.approx_proximal_logprobs`` gives the reasoning)."""
    behav, theta, g = np.array([-2.0, -2.0], np.float32), np.array([-1.0, -1.0], np.float32), 5
    versions = np.array([g, g - 1])
    ours = np.asarray(approx_proximal_logprobs(behav, theta, versions, g))
    theirs = areal_loglinear(behav, theta, versions, g)
    np.testing.assert_allclose(ours, [-2.0, -1.5])
    np.testing.assert_allclose(theirs, [-2.0, -2.0])


def test_kl_reward_is_clamped_at_ten():
    lp, ref = np.array([-1.0, -1.0, -50.0]), np.array([-1.5, -40.0, -1.0])
    for est in ("k1", "k2", "k3"):
        np.testing.assert_allclose(kl_penalty_estimate(est, lp, ref), areal_kl(lp, ref, est), rtol=1e-6)
    assert float(kl_penalty_estimate("k1", lp, ref)[1]) == 10.0


def test_overlong_penalty_floor_beyond_max_len_differs_from_areal():
    """Deliberate difference, out of reach of a single-turn answer: past ``max_len`` (only a
    multi-turn answer's trained tokens can get there) AReaL's ramp keeps falling; ours stays at
    ``-penalty_factor``, DAPO's paper's full penalty."""
    from areal_jax.algo import overlong_penalty

    lengths = np.array([10, 16, 20, 24])
    ours = np.asarray(overlong_penalty(lengths, max_len=20, buffer_len=8, penalty_factor=1.0))
    theirs = np.minimum(-(lengths - (20 - 8)) / 8 * 1.0, 0.0)
    np.testing.assert_allclose(ours[:3], theirs[:3])
    assert ours[3] == -1.0 and theirs[3] == -1.5
