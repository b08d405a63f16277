"""The engine's compiled steps: batched prefill into KV slots, a copy of prefilled slots into
others (requests that share a prompt) and a multi-token decode chunk.

All are pure functions of ``(model state, cache, slot state, ...)``, jitted once per engine over a
fixed graphdef with the cache and slot state donated. Their shapes come from small bucket sets
(prompt length x prefill rows for prefill, attended length for decode), so the number of
compilations is bounded whatever the traffic. A prompt longer than the prefill chunk runs as
``prefill_chunk`` calls (write one chunk's keys and values, attend to the cache so far) and a final
``prefill`` at the last chunk's offset, so attention never holds more than ``chunk x context``
scores. Sampling runs inside the same call, and each call
returns one small float32 array (token ids and their logprobs) to the host.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.inference.config import EngineConfig, powers_of_two
from areal_jax.inference.sampling import row_keys, sample
from areal_jax.models.decoder import Decoder
from areal_jax.models.slot_cache import KVCache
from sharding import constrain

DEVICE_STOP_IDS = 8
"""Stop token ids per slot that a decode chunk checks on the device."""


class SlotState(NamedTuple):
    """Device-resident state of every KV slot, ``[num_slots]`` each."""

    tokens: jax.Array
    """Last sampled token, not yet in the cache (int32)."""
    positions: jax.Array
    """Position that token will occupy (int32)."""
    step: jax.Array
    """Index of the next token to sample within its request (int32), for the PRNG stream."""
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    stream: jax.Array
    top_n: jax.Array
    """How many of the likeliest tokens to report at each step (``top_logprobs_num``; 0: none)."""
    remaining: jax.Array
    """Tokens the request may still sample (its length limit), so a decode chunk sees it end."""
    stop_ids: jax.Array
    """``[num_slots, DEVICE_STOP_IDS]`` token ids that end the request (eos unless ignored, then
    its stop ids; -1 pads). A request with more keeps its extra ones on the host only."""

    @classmethod
    def empty(cls, num_slots: int) -> SlotState:
        zi = lambda: jnp.zeros((num_slots,), jnp.int32)  # distinct buffers: each is donated
        return cls(zi(), zi(), zi(), jnp.ones((num_slots,), jnp.float32), jnp.ones((num_slots,), jnp.float32),
                   jnp.full((num_slots,), -1, jnp.int32), jnp.zeros((num_slots,), jnp.uint32),
                   jnp.zeros((num_slots,), jnp.uint32), zi(), zi(),
                   jnp.full((num_slots, DEVICE_STOP_IDS), -1, jnp.int32))


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """Smallest bucket >= n (the largest one if none is)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]


def share_rows(lane_slots: int) -> tuple[int, ...]:
    """Padded row counts of a ``share`` call (requests given a copy of another's prefill) in a lane
    of ``lane_slots`` slots."""
    return (*powers_of_two(1, lane_slots), lane_slots)


def step_shapes(cfg: EngineConfig, lane_slots: int) -> list[tuple[str, int, int, int]]:
    """Every compiled-step shape an engine's scheduler can ask for (lanes of ``lane_slots``), as
    ``(step, rows, length, kv_len)``: ``prefill`` (rows padded, a length bucket, or the chunk size
    for a long prompt's last chunk), ``prefill_chunk`` (one row, the chunk, the cache so far) and
    ``decode`` (rows and length unused: every slot steps); with ``share_prompts``, ``share`` (rows
    padded)."""
    chunk = cfg.prefill_chunk
    most = min(lane_slots, cfg.max_prefill_batch)
    shapes = []
    top = cfg.max_seq_len if chunk is None else bucket(chunk, cfg.prefill_buckets)
    for length in (b for b in cfg.prefill_buckets if b <= top):
        fewest = 1  # the fewest prompts that pad to each row count
        for rows in cfg.prefill_rows:
            if fewest <= most and (fewest == 1 or fewest * length <= cfg.max_prefill_tokens):
                shapes.append(("prefill", rows, length, length))
            fewest = rows + 1
    if chunk is not None:
        longest = cfg.max_seq_len - 1  # a prompt leaves room for one token
        shapes += [("prefill", 1, chunk, kv) for kv in cfg.kv_buckets if kv > chunk]
        shapes += sorted({("prefill_chunk", 1, chunk, bucket(offset + chunk, cfg.kv_buckets))
                          for offset in range(0, longest - chunk, chunk)})
    if cfg.share_prompts:
        shapes += [("share", rows, 0, 0) for rows in share_rows(lane_slots)]
    shapes += [("decode", 0, 0, kv) for kv in cfg.kv_buckets]
    return shapes


def _forward(model: Decoder, ids: jax.Array, positions: jax.Array, cache: KVCache, kv_len: int,
             slots: jax.Array | None) -> tuple[jax.Array, KVCache]:
    """Final hidden states ``[b, t, hidden]`` and the updated cache (logits are left to the caller,
    so prefill projects only each row's last position onto the vocabulary)."""
    x, cache = model.decode_layers(model.embed_tokens(ids), positions, cache, kv_len=kv_len, slots=slots)
    return model.norm(x), cache


def top_logprobs(logits: jax.Array, temperature: jax.Array, top_n: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Logprobs and ids ``[b, k]`` of the ``k`` likeliest tokens under ``log_softmax(logits / T)``
    (T=1 for greedy rows), computed only when some row has ``top_n > 0`` (else zeros)."""
    rows = logits.shape[0]

    def compute(_: None) -> tuple[jax.Array, jax.Array]:
        temp = jnp.where(temperature <= 0, 1.0, temperature)
        values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32) / temp[:, None], axis=-1), k)
        return values, ids.astype(jnp.int32)

    def skip(_: None) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((rows, k), jnp.float32), jnp.zeros((rows, k), jnp.int32)

    return jax.lax.cond(jnp.any(top_n > 0), compute, skip, None)


def _replicated(tree: Any) -> Any:
    return jax.tree.map(lambda x: constrain(x, (None,) * x.ndim), tree)


def _chunk_positions(ids: jax.Array, offset: jax.Array, lengths: jax.Array, max_len: int) -> jax.Array:
    """Positions of ``ids [rows, T]`` placed at ``offset``; padding lands past the cache (dropped)."""
    pos = offset + jnp.arange(ids.shape[1])[None]
    return jnp.broadcast_to(jnp.where(pos < lengths[:, None], pos, max_len), ids.shape)


def _prefill_chunk(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, ids: jax.Array, offset: jax.Array,
                   lengths: jax.Array, slots: jax.Array, *, kv_len: int) -> KVCache:
    """Write one chunk ``ids [rows, T]`` at positions ``offset ..`` into ``slots``, attending to the
    first ``kv_len`` cache positions (a bucket >= offset + T); nothing is sampled."""
    model = nnx.merge(graphdef, state)
    _, cache = _forward(model, ids, _chunk_positions(ids, offset, lengths, cache.max_len), cache, kv_len, slots)
    return cache


def _prefill(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, slot_state: SlotState,
             ids: jax.Array, offset: jax.Array, lengths: jax.Array, slots: jax.Array, first_step: jax.Array,
             temperature: jax.Array, top_p: jax.Array, top_k: jax.Array, seed: jax.Array,
             stream: jax.Array, top_n: jax.Array, remaining: jax.Array, stop_ids: jax.Array, *, kv_len: int,
             max_top: int) -> tuple[KVCache, SlotState, tuple[jax.Array, jax.Array, jax.Array]]:
    """Write ``ids [rows, T]`` (row i: tokens ``offset ..`` of ``lengths[i]``) into ``slots`` and
    sample each row's next token; every row's last token must lie in this call (an unchunked
    prefill has ``offset`` 0 and ``kv_len`` T). Padding rows have length 0 and slot
    ``num_slots``: all their writes drop."""
    model = nnx.merge(graphdef, state)
    positions = _chunk_positions(ids, offset, lengths, cache.max_len)
    hidden, cache = _forward(model, ids, positions, cache, kv_len, slots)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1 - offset, 0)[:, None, None], axis=1)
    logits = model.logits_from_hidden(last)[:, 0]
    tokens, logprobs = sample(logits, temperature, top_p, top_k, row_keys(seed, stream, first_step))
    tops = top_logprobs(logits, temperature, top_n, max_top)
    put = lambda arr, val: arr.at[slots].set(val.astype(arr.dtype), mode="drop")
    slot_state = SlotState(
        put(slot_state.tokens, tokens), put(slot_state.positions, lengths), put(slot_state.step, first_step + 1),
        put(slot_state.temperature, temperature), put(slot_state.top_p, top_p), put(slot_state.top_k, top_k),
        put(slot_state.seed, seed), put(slot_state.stream, stream), put(slot_state.top_n, top_n),
        put(slot_state.remaining, remaining), put(slot_state.stop_ids, stop_ids))
    return cache, _replicated(slot_state), (jnp.stack([tokens.astype(jnp.float32), logprobs]), *tops)


SHARE_BLOCK = 64
"""Cache positions copied per iteration of ``_share``."""


def _share(cache: KVCache, slot_state: SlotState, src: jax.Array, dst: jax.Array, length: jax.Array,
           tokens: jax.Array, positions: jax.Array, step: jax.Array, temperature: jax.Array, top_p: jax.Array,
           top_k: jax.Array, seed: jax.Array, stream: jax.Array, top_n: jax.Array, remaining: jax.Array,
           stop_ids: jax.Array) -> tuple[KVCache, SlotState]:
    """Give slot ``dst[i]`` the keys and values of slot ``src[i]`` at positions ``0 .. length - 1``
    (a bound over the rows, copied in blocks of ``SHARE_BLOCK``), and its own slot state: a prompt
    prefilled once serves every request that sent it. Each ``dst`` row is set up to sample its
    first token in the next decode chunk: its last prompt token as the slot's token, at that
    token's position (the chunk writes that position's keys and values again and samples from
    it), ``step`` the index of that first token and ``remaining`` every token it may sample.
    Padding rows have ``dst`` = ``num_slots``: every write drops."""
    max_len = cache.max_len
    block = min(SHARE_BLOCK, max_len)

    def copy(i: jax.Array, c: KVCache) -> KVCache:
        # A block that would run past the cache is moved back inside it: it copies some positions twice, alike.
        pos = (jnp.minimum(i * block, max_len - block) + jnp.arange(block))[None, :]
        rows_from, rows_to = src[:, None], dst[:, None]
        k = c.k.at[:, rows_to, :, :, pos].set(c.k[:, rows_from, :, :, pos], mode="drop")
        v = c.v.at[:, rows_to, :, pos, :].set(c.v[:, rows_from, :, pos, :], mode="drop")
        return KVCache(k, v)

    cache = jax.lax.fori_loop(0, (length + block - 1) // block, copy, cache)
    put = lambda arr, val: arr.at[dst].set(val.astype(arr.dtype), mode="drop")
    slot_state = SlotState(
        put(slot_state.tokens, tokens), put(slot_state.positions, positions), put(slot_state.step, step),
        put(slot_state.temperature, temperature), put(slot_state.top_p, top_p), put(slot_state.top_k, top_k),
        put(slot_state.seed, seed), put(slot_state.stream, stream), put(slot_state.top_n, top_n),
        put(slot_state.remaining, remaining), put(slot_state.stop_ids, stop_ids))
    return cache, _replicated(slot_state)


def _decode(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache, slot_state: SlotState, active: jax.Array,
            early: jax.Array, *, kv_len: int, num_steps: int,
            max_top: int) -> tuple[KVCache, SlotState, tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    """Advance every slot up to ``num_steps`` tokens, attending to the first ``kv_len`` cache
    positions. With ``early`` (requests are waiting for a slot), the chunk ends after the step at
    which some active request samples a stop token or reaches its length, so its slot is free for
    the next call instead of idling to the chunk's end.

    ``active [num_slots]`` marks the slots that hold a request. A free slot's sampling parameters
    are reset to SGLang's defaults first: a finished top-p or top-k request must not keep every
    later step on the sorting path. Returns the cache, the slot state and
    ``([2, num_steps, num_slots]`` token ids (as float32, exact below 2**24) and logprobs,
    ``[num_steps, num_slots, max_top]`` top logprobs and their ids, the number of steps run);
    rows past that number are zeros. Free slots compute garbage the host ignores; their writes go
    to their own (free) slot or past the cache.
    """
    model = nnx.merge(graphdef, state)
    slot_state = slot_state._replace(temperature=jnp.where(active, slot_state.temperature, 1.0),
                                     top_p=jnp.where(active, slot_state.top_p, 1.0),
                                     top_k=jnp.where(active, slot_state.top_k, -1),
                                     top_n=jnp.where(active, slot_state.top_n, 0))

    slots = active.shape[0]

    def one(carry: tuple) -> tuple:
        i, live, ended, cache, s, out, top_values, top_ids = carry
        hidden, cache = _forward(model, s.tokens[:, None], s.positions[:, None], cache, kv_len, None)
        logits = model.logits_from_hidden(hidden)[:, 0]
        tokens, logprobs = sample(logits, s.temperature, s.top_p, s.top_k, row_keys(s.seed, s.stream, s.step))
        values, ids = top_logprobs(logits, s.temperature, s.top_n, max_top)
        ends = live & (jnp.any(tokens[:, None] == s.stop_ids, axis=-1) | (s.remaining <= 1))
        s = s._replace(tokens=tokens, positions=s.positions + 1, step=s.step + 1, remaining=s.remaining - 1)
        out = out.at[:, i].set(jnp.stack([tokens.astype(jnp.float32), logprobs]))
        return (i + 1, live & ~ends, ended | jnp.any(ends), cache, s, out, top_values.at[i].set(values),
                top_ids.at[i].set(ids))

    def more(carry: tuple) -> jax.Array:
        i, _, ended = carry[:3]
        return (i < num_steps) & ~(early & ended)

    start = (jnp.int32(0), active, jnp.bool_(False), cache, slot_state, jnp.zeros((2, num_steps, slots), jnp.float32),
             jnp.zeros((num_steps, slots, max_top), jnp.float32), jnp.zeros((num_steps, slots, max_top), jnp.int32))
    steps, _, _, cache, slot_state, out, top_values, top_ids = jax.lax.while_loop(more, one, start)
    return cache, _replicated(slot_state), (out, top_values, top_ids, steps)


def _prompt_logprobs(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array, temperature: jax.Array, *,
                     max_top: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For a prompt ``ids [1, T]`` (right padding is inert under causal attention): at each
    position t >= 1, the logprob of ``ids[t]`` given the tokens before it, and the ``max_top``
    likeliest tokens there, under ``log_softmax(logits / T)``; row t describes position t + 1."""
    model = nnx.merge(graphdef, state)
    logits = model(ids)[0, :-1]
    temp = jnp.where(temperature <= 0, 1.0, temperature)
    logp = jax.nn.log_softmax(logits / temp, axis=-1)
    chosen = jnp.take_along_axis(logp, ids[0, 1:, None], axis=-1)[:, 0]
    values, top = jax.lax.top_k(logp, max_top)
    return chosen, values, top.astype(jnp.int32)


class Steps(NamedTuple):
    """The compiled steps of one model graph (cache and slot state donated)."""

    prefill: Any
    prefill_chunk: Any
    share: Any
    decode: Any
    prompt_logprobs: Any


def compile_steps(graphdef: nnx.GraphDef, max_top: int) -> Steps:
    """The steps jitted for one model graph, donating cache and slot state; ``max_top`` is the
    most top logprobs a step reports per token."""
    return Steps(
        prefill=jax.jit(partial(_prefill, graphdef, max_top=max_top), donate_argnums=(1, 2),
                        static_argnames=("kv_len",)),
        prefill_chunk=jax.jit(partial(_prefill_chunk, graphdef), donate_argnums=(1,), static_argnames=("kv_len",)),
        # A fresh callable, as the others are: its compiled shapes are this engine's own to count.
        share=jax.jit(partial(_share), donate_argnums=(0, 1)),
        decode=jax.jit(partial(_decode, graphdef, max_top=max_top), donate_argnums=(1, 2),
                       static_argnames=("kv_len", "num_steps")),
        prompt_logprobs=jax.jit(partial(_prompt_logprobs, graphdef, max_top=max_top)))
