"""On-device token sampling: temperature, top-k, top-p, greedy, and per-request PRNG streams.

Every row carries its own parameters, so one jitted call samples a batch of requests with
different settings. The returned logprob is ``log_softmax(logits / T)`` over the full
vocabulary at the sampled token (SGLang's convention; T=1 for greedy rows), i.e. the behaviour
policy's probability before top-k/top-p truncation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche (xor-shift-multiply rounds)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: jax.Array, stream: jax.Array, step: jax.Array) -> jax.Array:
    """One 32-bit key per row from ``(seed, stream, step)``, each ``[b]`` of integers.

    A seeded request uses (its seed, stream 0); others use (engine seed, request counter). The
    step is the index of the token being sampled, so a request recomputed after a retract draws
    the same numbers it would have drawn without one. A counter-based hash, not ``jax.random``:
    threefry keys per row cost seconds of compile time per step shape, and a hash is enough to
    drive one categorical draw per token.
    """
    u32 = lambda x: jnp.asarray(x).astype(jnp.uint32)
    h = _mix(u32(seed) ^ jnp.uint32(0x9E3779B9))
    h = _mix(h ^ u32(stream) * jnp.uint32(0x85EBCA6B))
    return _mix(h ^ u32(step) * jnp.uint32(0xC2B2AE35))


def gumbel_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """Standard Gumbel noise ``[b, vocab]``, a pure function of each row's key."""
    bits = _mix(_mix(keys[:, None] ^ (jnp.arange(vocab, dtype=jnp.uint32) * jnp.uint32(0x27D4EB2F))[None]))
    uniform = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24)) + 0.5 / (1 << 24)  # in (0, 1)
    return -jnp.log(-jnp.log(uniform))


def sample(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array,
           keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row of ``logits [b, vocab]``; returns ``(ids int32 [b], logprobs [b])``.

    ``temperature [b]`` (0 = greedy), ``top_p [b]`` in (0, 1], ``top_k [b]`` (-1 = all), ``keys [b]``.
    Sampling is Gumbel-max over the truncated distribution; the vocabulary sort that top-k/top-p
    need runs only when some row asks for truncation.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = jnp.where(greedy, 1.0, temperature)
    logp = jax.nn.log_softmax(logits / temp[:, None], axis=-1)
    gumbel = gumbel_noise(keys, vocab)

    def truncated(_: None) -> jax.Array:
        order = jnp.argsort(-logp, axis=-1)
        sorted_logp = jnp.take_along_axis(logp, order, axis=-1)
        probs = jnp.exp(sorted_logp)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        k = jnp.where(top_k < 0, vocab, top_k)
        rank = jnp.arange(vocab)
        keep = (rank[None] < k[:, None]) & ((before < top_p[:, None]) | (rank[None] == 0))
        choice = jnp.argmax(jnp.where(keep, sorted_logp + jnp.take_along_axis(gumbel, order, axis=-1), -jnp.inf),
                            axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]

    def full(_: None) -> jax.Array:
        return jnp.argmax(logp + gumbel, axis=-1)

    needs_cut = jnp.any(((top_p < 1) | (top_k > 0)) & ~greedy)
    sampled = jax.lax.cond(needs_cut, truncated, full, None)
    ids = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    return ids, jnp.take_along_axis(logp, ids[:, None], axis=-1)[:, 0]
