"""Per-token KL estimators and the KL loss term (against a frozen reference policy).

A KL to a frozen reference policy enters training in one of two forms (or both):

* ``AlgoConfig.kl_coef``: AReaL's form (verl's ``use_kl_in_reward``), a per-token *reward*
  ``-kl_coef * kl`` on the behaviour logprobs, the estimate clamped to ``+-KL_CLAMP``; it joins
  the task reward inside ``compute_advantages`` (``algo/config.py``), where AReaL adds it, so it
  moves the policy only through the advantages.
* ``AlgoConfig.kl_loss_coef``: the *loss* form of GRPO, Tunix and verl's ``use_kl_loss``,
  ``kl_loss_coef * kl_loss_term(...)`` added to the policy loss, on the logprobs being trained,
  so its gradient pulls the policy towards the reference directly (``kl_loss_term``).

With both coefficients 0 the trainer builds no reference model and never calls these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``logp - logp_ref``: unbiased for KL(pi || ref) on tokens sampled from pi, can be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``0.5 * (logp - logp_ref)^2``: biased but low variance, never negative."""
    return 0.5 * jnp.square(logprobs - ref_logprobs)


def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """``exp(logp_ref - logp) - (logp_ref - logp) - 1``: unbiased and never negative."""
    log_ratio = ref_logprobs - logprobs
    return jnp.expm1(log_ratio) - log_ratio


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}

KL_CLAMP = 10.0
"""AReaL's bound on a per-token KL estimate (``KLEstimator``'s clamp): one token whose logprob
fell far under the reference cannot swamp its answer's reward."""


def kl_penalty_estimate(name: str, logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """The per-token KL of the reward penalty: estimator ``name`` clamped to ``+-KL_CLAMP``."""
    return jnp.clip(KL_ESTIMATORS[name](logprobs, ref_logprobs), -KL_CLAMP, KL_CLAMP)


KL_LOSS_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
"""Estimators of the KL loss term; ``low_var_kl`` is verl's name for ``k3``."""


def kl_loss_estimate(name: str, logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """The per-token KL of the loss term, verl's ``kl_penalty`` forms: ``k1`` and ``k2`` as the
    reward's, unclamped; ``k3``/``low_var_kl`` with ``ref - logp`` clamped to ``+-20`` before
    the exponential and the estimate to ``+-10`` after (the exponential is what can explode)."""
    if name == "k1":
        return kl_k1(logprobs, ref_logprobs)
    if name == "k2":
        return kl_k2(logprobs, ref_logprobs)
    if name in ("k3", "low_var_kl"):
        log_ratio = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
        return jnp.clip(jnp.expm1(log_ratio) - log_ratio, -10.0, 10.0)
    raise ValueError(f"kl_loss_estimator must be one of {KL_LOSS_ESTIMATORS}, got {name!r}")


def kl_loss_term(
    logprobs: jax.Array, ref_logprobs: jax.Array, loss_mask: jax.Array, estimator: str, *,
    aggregation: str = "token_mean", constant_normalizer: float | None = None, seq_ids: jax.Array | None = None,
) -> jax.Array:
    """The KL-to-reference loss term (before its coefficient): ``estimator``'s per-token KL of
    the logprobs being trained against the reference's, aggregated over the masked tokens as the
    policy loss is (verl's ``agg_loss`` with the actor's ``loss_agg_mode``): ``token_mean``,
    ``seq_mean_token_mean`` (per-sequence token means, averaged; needs ``seq_ids`` on packed
    rows) or ``constant`` (the sum over ``constant_normalizer``). Gradient flows through
    ``logprobs`` only."""
    ref_logprobs = jax.lax.stop_gradient(jnp.asarray(ref_logprobs).astype(logprobs.dtype))
    mask = jnp.asarray(loss_mask).astype(logprobs.dtype)
    masked = mask > 0
    # Padding may hold any logprob; where() keeps a non-finite estimate there out of the gradient.
    kl = jnp.where(masked, kl_loss_estimate(estimator, jnp.where(masked, logprobs, 0.0),
                                            jnp.where(masked, ref_logprobs, 0.0)), 0.0)
    if aggregation == "token_mean":
        return jnp.sum(kl) / jnp.maximum(jnp.sum(mask), 1.0)
    if aggregation == "constant":
        if constant_normalizer is None:
            raise ValueError("aggregation='constant' needs constant_normalizer")
        return jnp.sum(kl) / constant_normalizer
    if seq_ids is None:
        if kl.ndim != 2:
            raise ValueError("seq_mean_token_mean on 1-D (packed) input needs seq_ids")
        seq_ids = jnp.broadcast_to(jnp.arange(kl.shape[0])[:, None], kl.shape)
    segs = jnp.reshape(jnp.asarray(seq_ids), -1).astype(jnp.int32)
    n = segs.shape[0] + 1
    seq_sum = jax.ops.segment_sum(jnp.reshape(kl, -1), segs, num_segments=n)
    seq_count = jax.ops.segment_sum(jnp.reshape(mask, -1), segs, num_segments=n)
    seq_mean = seq_sum / jnp.maximum(seq_count, 1.0)
    return jnp.sum(seq_mean) / jnp.maximum(jnp.sum(seq_count > 0), 1)

