"""Per-token KL estimators (the reward penalty against a reference policy).

The KL penalty is against a frozen reference policy; its per-token estimate is clamped to
``+-KL_CLAMP`` as AReaL's. ``AlgoConfig.kl_coef`` controls it, and
``kl_coef == 0`` means the trainer builds no reference model at all and never calls these. The
penalty itself, ``-kl_coef * kl`` per masked token, joins the task reward inside
``compute_advantages`` (``algo/config.py``), where AReaL adds it.
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
