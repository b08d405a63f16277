"""On-device token sampling: temperature, top-k, top-p, greedy, and per-request PRNG streams.

Every row carries its own parameters, so one jitted call samples a batch of requests with
different settings. The returned logprob is ``log_softmax(logits / T)`` over the full
vocabulary at the sampled token (SGLang's convention; T=1 for greedy rows), i.e. the behaviour
policy's probability before top-k/top-p truncation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_keys(seed: jax.Array, stream: jax.Array, step: jax.Array) -> jax.Array:
    """One PRNG key per row from ``(seed, stream, step)``, each ``[b]`` of integers.

    A seeded request uses (its seed, stream 0); others use (engine seed, request counter). The
    step is the index of the token being sampled, so a request recomputed after a retract draws
    the same numbers it would have drawn without one.
    """
    def one(s: jax.Array, r: jax.Array, t: jax.Array) -> jax.Array:
        key = jax.random.key(s.astype(jnp.uint32))
        return jax.random.fold_in(jax.random.fold_in(key, r), t)

    return jax.vmap(one)(seed, stream, step)


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
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)

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
