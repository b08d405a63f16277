"""The critic's side of PPO: the clipped value loss and the explained variance of its predictions.

Arrays are per token and share one layout (``[batch, tokens]`` or packed rows); the mask selects
the answer tokens the critic is trained on. Pure functions, so they jit and differentiate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def clipped_value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    loss_mask: jax.Array,
    *,
    eps_clip: float | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO's clipped value loss, a masked token mean::

        V_clip = V_old + clip(V - V_old, -eps_clip, eps_clip)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)

    The max makes the loss pessimistic: a step cannot profit from moving a value further than
    ``eps_clip`` from the one the returns were computed with. ``eps_clip=None`` is the plain
    squared error. Stats: ``value_loss`` (the loss) and ``value_clip_fraction`` (share of masked
    tokens where the clipped term is the larger one, i.e. where the gradient is cut).
    """
    mask = jnp.asarray(loss_mask, jnp.float32) > 0
    values = values.astype(jnp.float32)
    old_values = jax.lax.stop_gradient(old_values.astype(jnp.float32))
    returns = jax.lax.stop_gradient(returns.astype(jnp.float32))
    # `where` rather than a product: padding may hold anything (even inf), and 0 * inf is NaN
    # in the forward pass and in the gradient.
    values = jnp.where(mask, values, 0.0)
    old_values = jnp.where(mask, old_values, 0.0)
    returns = jnp.where(mask, returns, 0.0)
    unclipped = jnp.square(values - returns)
    if eps_clip is None:
        per_token, clipped_wins = unclipped, jnp.zeros_like(mask)
    else:
        clipped_values = old_values + jnp.clip(values - old_values, -eps_clip, eps_clip)
        clipped = jnp.square(clipped_values - returns)
        per_token = jnp.maximum(unclipped, clipped)
        # Inside the clip range the two terms are equal up to float rounding; only a value that
        # left the range can make the clipped term win.
        clipped_wins = (jnp.abs(values - old_values) > eps_clip) & (clipped > unclipped)
    count = jnp.maximum(mask.sum(), 1)
    loss = 0.5 * jnp.sum(jnp.where(mask, per_token, 0.0)) / count
    clip_fraction = jnp.sum(clipped_wins & mask) / count
    return loss, {"value_loss": loss, "value_clip_fraction": clip_fraction}


def explained_variance(values: jax.Array, returns: jax.Array, loss_mask: jax.Array) -> jax.Array:
    """``1 - Var(R - V) / Var(R)`` over masked tokens: 1 is a perfect critic, 0 no better than
    the mean return, negative worse than that. 0 when the returns do not vary."""
    mask = jnp.asarray(loss_mask, jnp.float32)
    count = jnp.maximum(mask.sum(), 1.0)

    def var(x: jax.Array) -> jax.Array:
        x = jnp.where(mask > 0, x.astype(jnp.float32), 0.0)
        mean = x.sum() / count
        return jnp.sum(jnp.square(x - mean) * mask) / count

    var_r = var(returns)
    return jnp.where(var_r > 0, 1.0 - var(returns - values) / jnp.where(var_r > 0, var_r, 1.0), 0.0)
