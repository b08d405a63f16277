"""Per-token log-probabilities and entropy at given targets, without holding ``[tokens, vocab]``.

Convention (shared with SGLang and the rollout side): ``log_softmax(logits / temperature)`` over
the whole vocabulary. Logits are formed chunk by chunk from hidden states and rematerialised in
the backward pass, so peak memory is one chunk of logits, not the whole sequence's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def logprobs_from_logits(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``log_softmax(logits / T)[target]`` for logits ``[..., vocab]`` and integer targets ``[...]``."""
    scaled = logits.astype(jnp.float32) / temperature
    picked = jnp.take_along_axis(scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(scaled, axis=-1)


def entropy_from_logits(logits: jax.Array, temperature: float = 1.0) -> jax.Array:
    scaled = logits.astype(jnp.float32) / temperature
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def chunked_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    to_logits: Callable[[jax.Array], jax.Array],
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Logprobs (and optionally entropy) of ``targets [b, t]`` from ``hidden [b, t, h]``.

    ``to_logits`` maps hidden ``[b, c, h]`` to logits ``[b, c, vocab]`` (the model's head). The
    token axis is split into chunks of ``chunk_size`` (padded up); each chunk's logits are
    recomputed in the backward pass instead of stored.
    """
    b, t, h = hidden.shape
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    hid = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n, c, h).swapaxes(0, 1)
    tgt = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, c).swapaxes(0, 1)

    @jax.checkpoint
    def one(args: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        hc, tc = args
        logits = to_logits(hc)
        lp = logprobs_from_logits(logits, tc, temperature)
        ent = entropy_from_logits(logits, temperature) if with_entropy else jnp.zeros_like(lp)
        return lp, ent

    lp, ent = jax.lax.map(one, (hid, tgt))
    lp = lp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t] if with_entropy else None
    return lp, ent
