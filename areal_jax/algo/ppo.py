"""The decoupled PPO policy loss of AReaL and its clipping, ratio and aggregation variants.

One loss covers GRPO, Dr.GRPO, DAPO, GSPO, M2PO and plain PPO: they differ only in how the ratio
is taken (token or sequence), how it is clipped, which tokens are dropped, and how per-token losses
are averaged. Each step follows AReaL's ``grpo_loss_fn`` / ``ppo_actor_loss_fn``
(``areal/trainer/ppo/actor.py``, ``areal/utils/functional/functional.py``); the transcription tests
in ``tests/algo/test_areal_transcription.py`` hold it to them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

RATIO_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "constant")


def _segment_ids_for(shape: tuple[int, ...], seq_ids: jax.Array | None) -> tuple[jax.Array, int]:
    """Flat per-token sequence ids and a static segment count for ``jax.ops.segment_sum``."""
    if seq_ids is not None:
        seq_ids = jnp.asarray(seq_ids).reshape(-1).astype(jnp.int32)
        # Ids are bounded by the token count, so this is a static upper bound on the segments.
        return seq_ids, seq_ids.shape[0] + 1
    if len(shape) == 2:
        rows = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)
        return rows.reshape(-1), shape[0]
    raise ValueError("sequence-level ratio or aggregation on 1-D (packed) input needs seq_ids")


def _masked_mean(x: jax.Array, mask: jax.Array, count: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0)) / count


def second_moment_keep(log_w: jax.Array, mask: jax.Array, threshold: float) -> jax.Array:
    """M2PO's token selection (Zheng et al. 2025): which masked tokens to keep so that the mean of
    ``log_w ** 2`` over the kept ones falls below ``threshold``.

    The masked tokens are ranked by ``log_w ** 2``, largest first, and the fewest leading ones are
    dropped that bring the mean of the rest under ``threshold``; if even the smallest alone is not
    under it, one token (the smallest) is kept. Ties are broken by position, so exactly that many
    tokens go. ``log_w`` and ``mask`` are flat; returns a bool array of their shape.
    """
    masked = mask > 0
    m2 = jnp.where(masked, jnp.square(log_w), 0.0)
    n = jnp.sum(masked.astype(jnp.int32))
    # Unmasked tokens sort after every masked one: their key is below any square.
    order = jnp.argsort(jnp.where(masked, -m2, 1.0), stable=True)
    sorted_m2 = m2[order]
    size = sorted_m2.shape[0]
    idx = jnp.arange(size, dtype=jnp.int32)
    # Mean of sorted_m2[i:n], the tokens left after dropping the i largest.
    suffix = jnp.sum(sorted_m2) - (jnp.cumsum(sorted_m2) - sorted_m2)
    rest_mean = suffix / jnp.maximum(n - idx, 1).astype(m2.dtype)
    over = (idx < n) & (rest_mean >= threshold)
    n_drop = jnp.minimum(jnp.sum(over.astype(jnp.int32)), jnp.maximum(n - 1, 0))
    rank = jnp.zeros(size, jnp.int32).at[order].set(idx)
    return masked & (rank >= n_drop)


def decoupled_ppo_loss(
    logprobs: jax.Array,
    proximal_logprobs: jax.Array,
    behavior_logprobs: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behavior_imp_weight_cap: float | None = None,
    use_behavior_imp_weight: bool = True,
    m2_threshold: float | None = None,
    use_decoupled: bool = True,
    ratio_level: str = "token",
    aggregation: str = "token_mean",
    seq_ids: jax.Array | None = None,
    constant_normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO objective (AReaL, eq. 5) as a loss to minimise, in the order AReaL's
    ``grpo_loss_fn`` and ``ppo_actor_loss_fn`` take its steps.

    All arrays are ``[tokens]`` (packed; sequences told apart by ``seq_ids``) or
    ``[batch, tokens]`` (one sequence per row unless ``seq_ids`` is given).

    1. **M2PO** (``m2_threshold``, Zheng et al. 2025; AReaL's ``m2_threshold``, 0.04 in its
       recipe): of the masked tokens, those with the largest ``(log w) ** 2``, where
       ``w = exp(proximal_logprobs - behavior_logprobs)``, leave the loss mask until the mean of
       the rest is below the threshold (``second_moment_keep``). They leave it as in AReaL:
       everything below, the token mean's count included, sees only the kept tokens.
    2. **Behaviour importance weight** (``use_behavior_imp_weight``; AReaL applies it when
       ``rejection_sampling`` is set): each token's loss is multiplied by
       ``stop_gradient(w)``, and tokens with ``w > behavior_imp_weight_cap`` get weight 0 (AReaL's
       ``rejection_sampling: {metric: ratio, level: token, action: mask, upper: cap}``). They
       stay in the token mean's count, as in AReaL, so dropping one does not re-weight the others.
    3. **Ratio**: ``token``: ``r = exp(logprobs - proximal_logprobs)`` per token. ``sequence``
       (GSPO, as AReaL does it): each sequence's ratio is ``exp(mean over its kept tokens of
       (logprobs - proximal_logprobs))``, the gradient flowing through that mean, and each token's
       advantage is replaced by the mean advantage of its sequence's kept tokens.
    4. **Clip**, per token, with advantage ``A``::

        L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher))
        L = min(L, c_clip * |A|)            where A < 0, if c_clip is set (dual clip)

    5. **Aggregation** of ``w * L`` over the kept tokens:

       - ``token_mean`` (AReaL's): ``sum / count`` with ``count`` the mask after M2PO.
       - ``seq_mean_token_mean``: the token mean within each sequence, then the mean over
         sequences that have a masked token (not an AReaL aggregation).
       - ``constant``: ``sum / constant_normalizer`` (Dr.GRPO's paper; not AReaL's Dr.GRPO recipe).

    ``use_decoupled=False`` is the naive (coupled) PPO the staleness ablation compares against:
    the ratio is taken against the behavior policy and there is no ``w``; ``proximal_logprobs``
    is then ignored (and ``m2_threshold`` is refused: there is no proximal policy to bound).

    The M2PO selection is over the arrays given: a micro-batch in the trainer, as in AReaL.

    Stats (scalars, over masked tokens): ``clip_fraction``, ``dual_clip_fraction``,
    ``ratio_mean``, ``behavior_imp_weight_mean`` / ``_max`` (before the cap drops anything),
    ``dropped_fraction`` (by the cap or M2PO), ``m2`` (the mean of ``(log w) ** 2`` before any
    drop), ``m2_dropped_fraction``, and ``behavior_kl``: the k3 estimate of KL(behavior || proximal),
    ``mean(w - 1 - log w)``, non-negative per token and unbiased because the tokens were sampled
    from the behavior policy.
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "constant" and constant_normalizer is None:
        raise ValueError("aggregation='constant' needs constant_normalizer")
    if isinstance(constant_normalizer, int | float) and not constant_normalizer > 0:
        raise ValueError(f"constant_normalizer must be positive, got {constant_normalizer}: a negative one "
                         f"would turn the loss's descent into ascent")
    if m2_threshold is not None and not m2_threshold > 0:
        raise ValueError(f"m2_threshold must be positive or None, got {m2_threshold}")
    if m2_threshold is not None and not use_decoupled:
        raise ValueError("m2_threshold bounds the proximal policy's distance from the behavior policy, which "
                         "naive PPO (use_decoupled=False) does not have: drop m2_threshold or use the decoupled loss")
    if behavior_imp_weight_cap is not None and not use_behavior_imp_weight:
        raise ValueError("behavior_imp_weight_cap drops tokens by a behaviour importance weight that "
                         "use_behavior_imp_weight=False does not apply: set the cap to None or turn the weight on")
    if eps_clip_higher is None:
        eps_clip_higher = eps_clip

    shape = jnp.shape(logprobs)
    logprobs = jnp.reshape(logprobs, -1)
    behavior_logprobs = jnp.reshape(behavior_logprobs, -1).astype(logprobs.dtype)
    if use_decoupled:
        proximal_logprobs = jnp.reshape(proximal_logprobs, -1).astype(logprobs.dtype)
    else:
        proximal_logprobs = behavior_logprobs
    # Neither reference policy is being optimised; only logprobs carries gradient.
    proximal_logprobs = jax.lax.stop_gradient(proximal_logprobs)
    behavior_logprobs = jax.lax.stop_gradient(behavior_logprobs)
    advantages = jax.lax.stop_gradient(jnp.reshape(advantages, -1).astype(logprobs.dtype))
    mask = jnp.reshape(loss_mask, -1).astype(logprobs.dtype)
    masked = mask > 0
    # Padding may hold arbitrary logprobs; zeroing the log-ratio there keeps exp finite, so no
    # NaN can leak into the gradient through a 0 * inf product.
    log_ratio = jnp.where(masked, logprobs - proximal_logprobs, 0.0)
    mask_count = jnp.maximum(jnp.sum(mask), 1.0)

    if use_decoupled:
        log_w = jnp.where(masked, proximal_logprobs - behavior_logprobs, 0.0)
        raw_w = jnp.exp(log_w)
    else:
        log_w = jnp.zeros_like(log_ratio)
        raw_w = jnp.ones_like(log_ratio)
    no = jnp.zeros_like(masked)
    m2_dropped = masked & ~second_moment_keep(log_w, mask, m2_threshold) if m2_threshold is not None else no
    in_loss = masked & ~m2_dropped  # AReaL's loss mask after M2PO: what the token mean counts
    capped = (raw_w > behavior_imp_weight_cap) if behavior_imp_weight_cap is not None else no
    w = jnp.where(capped, 0.0, raw_w) if use_decoupled and use_behavior_imp_weight else jnp.ones_like(raw_w)
    kept = in_loss & ~capped  # the tokens that carry gradient: AReaL's mask after rejection sampling

    needs_segments = ratio_level == "sequence" or aggregation == "seq_mean_token_mean"
    if needs_segments:
        segs, num_segments = _segment_ids_for(shape, seq_ids)
        seg_sum = lambda x: jax.ops.segment_sum(x, segs, num_segments=num_segments)  # noqa: E731

    if ratio_level == "sequence":
        kept_f = kept.astype(mask.dtype)
        seq_count = jnp.maximum(seg_sum(kept_f), 1.0)
        ratio = jnp.exp((seg_sum(log_ratio * kept_f) / seq_count)[segs])
        advantages = (seg_sum(advantages * kept_f) / seq_count)[segs]
    else:
        ratio = jnp.exp(log_ratio)

    # The gradient at the clip's edges follows AReaL's (PyTorch's): the clip passes it at a ratio
    # on the bound, and of two equal branches either one's (they are the same there). jnp.clip
    # and jnp.maximum would halve it at each tie, and a ratio of exactly 1 (one minibatch, own
    # proximal logprobs) sits on both bounds of M2PO's ``eps_clip: 0``.
    low, high = 1.0 - eps_clip, 1.0 + eps_clip_higher
    inside = (ratio >= low) & (ratio <= high)
    clipped_ratio = jnp.where(inside, ratio, jax.lax.stop_gradient(jnp.clip(ratio, low, high)))
    unclipped = -advantages * ratio
    clipped = -advantages * clipped_ratio
    per_token = jnp.where(unclipped >= clipped, unclipped, clipped)
    is_clipped = clipped > unclipped
    if c_clip is not None:
        dual_bound = c_clip * jnp.abs(advantages)
        is_dual_clipped = (advantages < 0) & (per_token > dual_bound)
        per_token = jnp.where(is_dual_clipped, dual_bound, per_token)
    else:
        is_dual_clipped = jnp.zeros_like(is_clipped)

    # where() rather than a product so a dropped or masked token cannot send gradient even
    # when its per-token loss is not finite.
    weighted = jnp.where(kept, w * per_token, 0.0)
    if aggregation == "token_mean":
        loss = jnp.sum(weighted) / jnp.maximum(jnp.sum(in_loss.astype(mask.dtype)), 1.0)
    elif aggregation == "constant":
        loss = jnp.sum(weighted) / constant_normalizer
    else:
        seq_loss = seg_sum(weighted) / jnp.maximum(seg_sum(in_loss.astype(mask.dtype)), 1.0)
        num_seqs = jnp.maximum(jnp.sum(seg_sum(mask) > 0), 1)
        loss = jnp.sum(seq_loss) / num_seqs

    dropped = capped | m2_dropped
    stats = {
        "clip_fraction": _masked_mean(is_clipped.astype(mask.dtype), mask, mask_count),
        "dual_clip_fraction": _masked_mean(is_dual_clipped.astype(mask.dtype), mask, mask_count),
        "ratio_mean": _masked_mean(ratio, mask, mask_count),
        "behavior_imp_weight_mean": _masked_mean(raw_w, mask, mask_count),
        "behavior_imp_weight_max": jnp.max(jnp.where(masked, raw_w, 0.0)),
        "dropped_fraction": _masked_mean(dropped.astype(mask.dtype), mask, mask_count),
        "m2": _masked_mean(jnp.square(log_w), mask, mask_count),
        "m2_dropped_fraction": _masked_mean(m2_dropped.astype(mask.dtype), mask, mask_count),
        "behavior_kl": _masked_mean(raw_w - 1.0 - log_w, mask, mask_count),
    }
    stats = {k: jax.lax.stop_gradient(v) for k, v in stats.items()}
    return loss, stats
