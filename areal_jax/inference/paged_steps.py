"""The paged engine's compiled steps (``inference.paged.PagedEngine``), pure functions of
``(graphdef, model state, pool, host arrays)`` jitted once per engine with the pool donated:

- ``prefill_step`` writes the keys and values of ``[rows, width]`` prompt tokens (the
  alternating path: a prefill call, then a decode call);
- ``decode_step`` advances every running request up to ``num_steps`` tokens in a loop on device;
- ``mixed_step`` runs one flat token batch, the first decode token of every running request
  beside rows of prefill tokens (``models.paged.mixed_paged_layers``); a ``decode_step`` call of
  the same rows then gives the answers their further tokens, so a prompt being prefilled never
  stalls the answers in flight (SGLang's mixed chunk).

Each takes the paged attention as a static ``attention_backend`` (``native`` or ``fa``,
``models.paged_kernels``): the engine passes its own choice at every call, so the choice is part
of the compiled step's signature and one model can serve engines that choose differently.

Sampling uses each request's own PRNG stream at the index of the token sampled
(``sampling.row_keys``), so a token is the same whichever step samples it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.inference.sampling import row_keys, sample
from areal_jax.inference.steps import top_logprobs
from areal_jax.models.attention import PagedWork
from areal_jax.models.decoder import PagedKVCache
from areal_jax.models.paged import Segment, mixed_paged_layers

__all__ = ["decode_step", "mixed_step", "prefill_step"]


def prefill_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, ids: jax.Array,
                  positions: jax.Array, write_pages: jax.Array, write_offsets: jax.Array,
                  work: tuple[jax.Array, ...], *, attention_backend: str = "native") -> PagedKVCache:
    """Write the keys and values of ``ids [rows, width]`` at ``positions`` (-1: padding) into the
    pool; nothing is sampled."""
    model = nnx.merge(graphdef, state)
    _, cache = model.decode_paged_layers(model.embed_tokens(ids), positions, cache, write_pages=write_pages,
                                         write_offsets=write_offsets, work=PagedWork(*work),
                                         backend=attention_backend)
    return cache


def decode_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, tokens: jax.Array,
                 positions: jax.Array, write_pages: jax.Array, write_offsets: jax.Array,
                 work: tuple[jax.Array, jax.Array, jax.Array], temperature: jax.Array, top_p: jax.Array,
                 top_k: jax.Array, seed: jax.Array, stream: jax.Array, step: jax.Array, top_n: jax.Array,
                 remaining: jax.Array, stop_ids: jax.Array, early: jax.Array, *, num_steps: int,
                 max_top: int, attention_backend: str = "native",
                 ended: jax.Array | bool = False) -> tuple[PagedKVCache, tuple[jax.Array, ...]]:
    """Advance each row up to ``min(num_steps, remaining)`` tokens: step ``i`` feeds the row's
    last token at ``positions + i``, writes its keys and values at ``write_pages[:, i]``,
    ``write_offsets[:, i]`` and samples the next with PRNG step ``step + i``. Every step reads
    through the same work list (it covers each row's last position; keys past a query's position
    are masked). Rows past their ``remaining`` (and padding rows, ``remaining`` 0) compute at
    position -1 and write to the sink page. With ``early``, the loop ends after a step at which
    some row stops (a stop token or its length), or at once when ``ended`` (a mixed step's first
    token stopped a row). Returns the pool and ``([2, num_steps, rows]``
    token ids (float32, exact below 2**24) and logprobs, ``[num_steps, rows, max_top]`` top
    logprobs and ids, the steps run)."""
    model = nnx.merge(graphdef, state)
    work = PagedWork(*work)
    rows = tokens.shape[0]

    def one(carry: tuple) -> tuple:
        i, live, ended, cache, tok, out, top_values, top_ids = carry
        pos = jnp.where(i < remaining, positions + i, -1)[:, None]
        wp = jax.lax.dynamic_slice_in_dim(write_pages, i, 1, axis=1)
        wo = jax.lax.dynamic_slice_in_dim(write_offsets, i, 1, axis=1)
        hidden, cache = model.decode_paged_layers(model.embed_tokens(tok[:, None]), pos, cache, write_pages=wp,
                                                  write_offsets=wo, work=work, backend=attention_backend)
        logits = model.logits_from_hidden(model.norm(hidden))[:, 0]
        new, logprobs = sample(logits, temperature, top_p, top_k, row_keys(seed, stream, step + i))
        values, ids = top_logprobs(logits, temperature, top_n, max_top)
        ends = live & (jnp.any(new[:, None] == stop_ids, axis=-1) | (remaining - i <= 1))
        out = out.at[:, i].set(jnp.stack([new.astype(jnp.float32), logprobs]))
        return (i + 1, live & ~ends, ended | jnp.any(ends), cache, new, out, top_values.at[i].set(values),
                top_ids.at[i].set(ids))

    def more(carry: tuple) -> jax.Array:
        i, _, ended = carry[:3]
        # and some row has a token left: a loop whose rows are all done stops (a mixed step's
        # further tokens are one fewer than the call's steps)
        return (i < num_steps) & ~(early & ended) & jnp.any(i < remaining)

    start = (jnp.int32(0), remaining > 0, jnp.bool_(ended), cache, tokens,
             jnp.zeros((2, num_steps, rows), jnp.float32), jnp.zeros((num_steps, rows, max_top), jnp.float32),
             jnp.zeros((num_steps, rows, max_top), jnp.int32))
    steps, _, _, cache, _, out, top_values, top_ids = jax.lax.while_loop(more, one, start)
    return cache, (out, top_values, top_ids, steps)


def mixed_step(graphdef: nnx.GraphDef, state: nnx.State, cache: PagedKVCache, tokens: jax.Array,
               positions: jax.Array, write_pages: jax.Array, write_offsets: jax.Array,
               work: tuple[jax.Array, jax.Array, jax.Array], ids: jax.Array, prefill_positions: jax.Array,
               prefill_pages: jax.Array, prefill_offsets: jax.Array,
               prefill_work: tuple[jax.Array, jax.Array, jax.Array], temperature: jax.Array, top_p: jax.Array,
               top_k: jax.Array, seed: jax.Array, stream: jax.Array, step: jax.Array, top_n: jax.Array,
               remaining: jax.Array, stop_ids: jax.Array, early: jax.Array, *, num_steps: int,
               max_top: int, attention_backend: str = "native") -> tuple[PagedKVCache, tuple[jax.Array, ...]]:
    """A prefill chunk ``ids [prefill rows, width]`` (a chunk of one request per row) computed
    in one flat batch with the first decode token of each of ``rows`` requests, in one call; the
    answers' further tokens are a ``decode_step`` call of the same rows after it (the engine
    makes it with the returned ``remaining``), so the decode loop is compiled once for both
    kinds of call rather than again inside every mixed shape.

    The flat batch has ``rows + prefill rows * width`` tokens: decode row ``i`` feeds
    ``tokens[i]`` at ``positions[i]`` (-1: a padding row), writes it at ``(write_pages[i, 0],
    write_offsets[i, 0])`` and samples with PRNG step ``step[i]``; prefill row ``j`` writes
    ``ids[j]`` at ``prefill_positions[j]`` (-1: padding) into ``prefill_pages[j],
    prefill_offsets[j]``, reading through ``prefill_work``, and samples nothing. The decode
    arguments are ``decode_step``'s. Returns the pool and ``([2, 1, rows]`` token ids and
    logprobs, ``[1, rows, max_top]`` top logprobs and ids, then each row's tokens left to
    decode: 0 for a row that stopped at its first, and whether some row stopped).
    ``num_steps`` is the decode call's (unused here: one signature for both)."""
    del num_steps
    model = nnx.merge(graphdef, state)
    rows, (prefill_rows, width) = tokens.shape[0], ids.shape
    flat = lambda a, b: jnp.concatenate([a, b.reshape(-1)])[None]
    segments = (Segment(rows, 1, PagedWork(*work)), Segment(prefill_rows, width, PagedWork(*prefill_work)))
    hidden, cache = mixed_paged_layers(model, model.embed_tokens(flat(tokens, ids)), flat(positions, prefill_positions),
                                       cache, write_pages=flat(write_pages[:, 0], prefill_pages),
                                       write_offsets=flat(write_offsets[:, 0], prefill_offsets), segments=segments,
                                       backend=attention_backend)
    logits = model.logits_from_hidden(model.norm(hidden[:, :rows]))[0]
    first, logprobs = sample(logits, temperature, top_p, top_k, row_keys(seed, stream, step))
    values, top_ids = top_logprobs(logits, temperature, top_n, max_top)
    out = jnp.stack([first.astype(jnp.float32), logprobs])[:, None]
    # rows that stopped at their first token decode no more (their later writes land in their own
    # reserved pages, past their end); with ``early`` the decode call is then not made at all
    stopped = (remaining > 0) & (jnp.any(first[:, None] == stop_ids, axis=-1) | (remaining <= 1))
    rest = jnp.where(stopped, 0, jnp.maximum(remaining - 1, 0))
    return cache, (out, values[None], top_ids[None], rest, jnp.any(stopped))
