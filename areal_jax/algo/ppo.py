"""The decoupled PPO policy loss of AReaL and its clipping, ratio and aggregation variants.

One loss covers GRPO, Dr.GRPO, DAPO, GSPO and plain PPO: they differ only in how the ratio is
taken (token or sequence), how it is clipped, and how per-token losses are averaged.
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
    m2_threshold: float | None = None,
    use_decoupled: bool = True,
    ratio_level: str = "token",
    aggregation: str = "token_mean",
    seq_ids: jax.Array | None = None,
    constant_normalizer: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Decoupled PPO objective (AReaL, eq. 5) as a loss to minimise.

    All arrays are ``[tokens]`` (packed; sequences told apart by ``seq_ids``) or
    ``[batch, tokens]`` (one sequence per row unless ``seq_ids`` is given).

    Per token, with ``r = exp(logprobs - proximal_logprobs)`` and advantage ``A``::

        L = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher))
        L = min(L, c_clip * |A|)            where A < 0, if c_clip is set (dual clip)
        w = stop_gradient(exp(proximal_logprobs - behavior_logprobs))
        w = 0                               where w > behavior_imp_weight_cap, if set
        w = 0                               on the tokens M2PO drops, if m2_threshold is set

    and the loss is the aggregation of ``w * L`` over ``loss_mask``:

    - ``token_mean``: ``sum(w * L * mask) / sum(mask)``; the mask is counted before any token
      is dropped (by the cap or M2PO), so dropping a token does not re-weight the others.
    - ``seq_mean_token_mean``: token mean within each sequence, then mean over sequences that
      have at least one masked token.
    - ``constant``: ``sum(w * L * mask) / constant_normalizer`` (Dr.GRPO).

    ``m2_threshold`` is M2PO's trust region against the behavior policy: of the masked tokens,
    those with the largest ``(log w) ** 2`` are dropped until the mean of the rest is below it
    (``second_moment_keep``; M2PO's and AReaL's ``m2_threshold``, 0.04 in their recipes). The
    proximal clip bounds how far one update moves from the proximal policy; this bounds how far
    the trained tokens' proximal policy may sit from the one that sampled them, and it drops only
    the outliers. The selection is over the arrays given: a micro-batch in the trainer.

    ``use_decoupled=False`` is the naive (coupled) PPO the staleness ablation compares against:
    the ratio is taken against the behavior policy and there is no ``w``; ``proximal_logprobs``
    is then ignored (and ``m2_threshold`` is refused: it would select nothing).

    ``ratio_level="sequence"`` is GSPO: the ratio of a sequence is
    ``s = exp(mean over its masked tokens of (logprobs - proximal_logprobs))`` and every token
    of it uses ``s``. Gradients follow GSPO-token: token ``t`` sees
    ``stop_gradient(s) * exp(logprobs_t - stop_gradient(logprobs_t))``, whose value is ``s`` and
    whose gradient is ``s * grad(logprobs_t)``. With an advantage constant over a sequence and
    ``seq_mean_token_mean`` this is exactly the GSPO sequence-level gradient.

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
    # Padding may hold arbitrary logprobs; zeroing the log-ratio there keeps exp finite, so no
    # NaN can leak into the gradient through a 0 * inf product.
    log_ratio = jnp.where(mask > 0, logprobs - proximal_logprobs, 0.0)
    mask_count = jnp.maximum(jnp.sum(mask), 1.0)

    needs_segments = ratio_level == "sequence" or aggregation == "seq_mean_token_mean"
    if needs_segments:
        segs, num_segments = _segment_ids_for(shape, seq_ids)
        seg_tokens = jax.ops.segment_sum(mask, segs, num_segments=num_segments)

    if ratio_level == "sequence":
        seq_log_ratio = jax.ops.segment_sum(log_ratio * mask, segs, num_segments=num_segments)
        seq_log_ratio = seq_log_ratio / jnp.maximum(seg_tokens, 1.0)
        token_log_ratio = jnp.where(mask > 0, logprobs - jax.lax.stop_gradient(logprobs), 0.0)
        log_ratio = jax.lax.stop_gradient(seq_log_ratio[segs]) + token_log_ratio
    ratio = jnp.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_higher)
    per_token = jnp.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if c_clip is not None:
        dual_bound = c_clip * jnp.abs(advantages)
        is_dual_clipped = (advantages < 0) & (per_token > dual_bound)
        per_token = jnp.where(is_dual_clipped, dual_bound, per_token)
    else:
        is_dual_clipped = jnp.zeros_like(is_clipped)

    if use_decoupled:
        log_w = jnp.where(mask > 0, proximal_logprobs - behavior_logprobs, 0.0)
        raw_w = jnp.exp(log_w)
    else:
        log_w = jnp.zeros_like(log_ratio)
        raw_w = jnp.ones_like(log_ratio)
    if behavior_imp_weight_cap is not None:
        dropped = raw_w > behavior_imp_weight_cap
    else:
        dropped = jnp.zeros_like(is_clipped)
    if m2_threshold is not None:
        m2_dropped = (mask > 0) & ~second_moment_keep(log_w, mask, m2_threshold)
        dropped = dropped | m2_dropped
    else:
        m2_dropped = jnp.zeros_like(is_clipped)
    w = jnp.where(dropped, 0.0, raw_w)

    # where() rather than a product so a dropped or masked token cannot send gradient even
    # when its per-token loss is not finite.
    weighted = jnp.where((mask > 0) & (w > 0), w * per_token, 0.0)
    if aggregation == "token_mean":
        loss = jnp.sum(weighted) / mask_count
    elif aggregation == "constant":
        loss = jnp.sum(weighted) / constant_normalizer
    else:
        seq_loss = jax.ops.segment_sum(weighted, segs, num_segments=num_segments)
        seq_loss = seq_loss / jnp.maximum(seg_tokens, 1.0)
        num_seqs = jnp.maximum(jnp.sum(seg_tokens > 0), 1)
        loss = jnp.sum(seq_loss) / num_seqs

    stats = {
        "clip_fraction": _masked_mean(is_clipped.astype(mask.dtype), mask, mask_count),
        "dual_clip_fraction": _masked_mean(is_dual_clipped.astype(mask.dtype), mask, mask_count),
        "ratio_mean": _masked_mean(ratio, mask, mask_count),
        "behavior_imp_weight_mean": _masked_mean(raw_w, mask, mask_count),
        "behavior_imp_weight_max": jnp.max(jnp.where(mask > 0, raw_w, 0.0)),
        "dropped_fraction": _masked_mean(dropped.astype(mask.dtype), mask, mask_count),
        "m2": _masked_mean(jnp.square(log_w), mask, mask_count),
        "m2_dropped_fraction": _masked_mean(m2_dropped.astype(mask.dtype), mask, mask_count),
        "behavior_kl": _masked_mean(raw_w - 1.0 - log_w, mask, mask_count),
    }
    stats = {k: jax.lax.stop_gradient(v) for k, v in stats.items()}
    return loss, stats
