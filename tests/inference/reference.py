"""Plain reference computations the engine is checked against: greedy decoding and logprobs
from the full forward pass, plus a sharpened tiny checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.hf_write import save_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint

T = TypeVar("T")

def sharpened_checkpoint(out: Path, seed: int, scale: float = 10.0) -> Path:
    """A tiny random model with its matrices scaled up: N(0, 0.02) weights give near-uniform
    logits and a greedy loop that repeats one token; scaled ones give varied paths."""
    base = make_tiny_checkpoint(out.with_name(out.name + "-base"), size="tiny", seed=seed)
    model = load_pretrained(base)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * scale if x.ndim == 2 else x, params))
    return save_pretrained(model, out, tokenizer_dir=base)


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)


def generate_all(engine: Any, requests: list) -> list:
    """Start ``engine``, run every request concurrently, stop it; the outputs in request order."""
    async def go() -> list:
        await engine.start()
        try:
            return await asyncio.gather(*(engine.generate(r) for r in requests))
        finally:
            await engine.stop()
    return run(go())


REF_LEN = 128  # references pad to this (or the next power of two), so the jitted forward compiles rarely


@jax.jit
def _forward(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(ids)


def _logits(model: Decoder, ids: list[int]) -> jax.Array:
    """Full-forward logits ``[len(ids), vocab]``; causal attention makes the right padding inert."""
    graphdef, state = nnx.split(model)
    padded = np.zeros((1, max(REF_LEN, 1 << (len(ids) - 1).bit_length())), np.int32)
    padded[0, :len(ids)] = ids
    return _forward(graphdef, state, jnp.asarray(padded))[0, :len(ids)]


def reference_greedy(model: Decoder, prompt: list[int], num_tokens: int, eos: Sequence[int] = ()) -> list[int]:
    """Greedy decoding with the full forward pass over the whole sequence at every step; stops
    after an ``eos`` token (kept, as the engine keeps it)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(jnp.argmax(_logits(model, ids)[-1])))
        if ids[-1] in eos:
            break
    return ids[len(prompt):]


def reference_logprobs(model: Decoder, prompt: list[int], output: list[int], temperature: float) -> np.ndarray:
    """``log_softmax(logits / T)`` at each output token, from one full forward pass (T=1 if 0)."""
    logits = _logits(model, prompt + output)[len(prompt) - 1:-1]
    logp = jax.nn.log_softmax(logits / (temperature or 1.0), axis=-1)
    return np.asarray(jnp.take_along_axis(logp, jnp.asarray(output)[:, None], axis=-1)[:, 0])


@partial(jax.jit, static_argnames=("block",))
def _layer_by_query_blocks(graphdef: nnx.GraphDef, state: nnx.State, x: jax.Array, block: int) -> jax.Array:
    """One decoder layer over ``x [1, t, hidden]`` (t a multiple of ``block``), its attention one
    block of queries at a time against all ``t`` keys under the causal mask."""
    layer = nnx.merge(graphdef, state)
    attn, t = layer.self_attn, x.shape[1]
    q, k, v = attn._qkv(layer.input_layernorm(x), jnp.arange(t)[None])  # noqa: SLF001 - its projections, RoPE
    kvh, d = k.shape[2:]
    g = q.shape[2] // kvh
    keys, values = k[0].transpose(1, 2, 0), v[0].transpose(1, 0, 2)  # [kvh, d, t], [kvh, t, d]

    def one_block(start: jax.Array) -> jax.Array:
        # the queries that share a kv head are the rows of one [g * block, d] x [d, t] product
        rows = jax.lax.dynamic_slice_in_dim(q[0], start, block, axis=0)
        rows = rows.reshape(block, kvh, g, d).transpose(1, 2, 0, 3).reshape(kvh, g * block, d)
        scores = jnp.matmul(rows, keys, precision=attn.precision) / np.sqrt(d)
        causal = jnp.arange(t)[None, :] <= start + jnp.arange(block)[:, None]
        probs = jax.nn.softmax(jnp.where(jnp.tile(causal, (g, 1))[None], scores, -jnp.inf), axis=-1)
        out = jnp.matmul(probs, values, precision=attn.precision)
        return out.reshape(kvh, g, block, d).transpose(2, 0, 1, 3).reshape(block, kvh * g * d)

    out = jax.lax.map(one_block, jnp.arange(0, t, block)).reshape(1, t, -1)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def reference_logprobs_by_query_blocks(model: Decoder, prompt: list[int], output: list[int],
                                       block: int = 512) -> np.ndarray:
    """``log_softmax(logits)`` ``[len(output), vocab]`` at each output token's position, for
    sequences too long for one full forward pass: the model's own layers over the whole sequence,
    one layer at a time, each layer's attention computed for ``block`` queries at a time against
    every key under the causal mask. Each query's softmax sees all its keys at once, so this is
    the full forward pass cut along the query axis only (no KV cache, no chunked prefill, no online
    softmax, and not the engine's attention function); it holds ``block x length`` scores per head."""
    n = len(prompt) + len(output)
    ids = np.zeros((1, -(-n // block) * block), np.int32)
    ids[0, :n] = prompt + output
    x = model.embed_tokens(jnp.asarray(ids))
    graphdef, stacked = nnx.split(model.layers)
    for i in range(model.config.num_hidden_layers):
        x = _layer_by_query_blocks(graphdef, jax.tree.map(lambda a: a[i], stacked), x, block)  # noqa: B023
    logits = model.logits_from_hidden(model.norm(x[:, len(prompt) - 1:n - 1]))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def prompts(lengths: list[int], seed: int = 0, vocab: int = 128) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).tolist() for n in lengths]


def joined(outputs: list) -> Any:
    """One output from a stream's pieces (``Engine.stream`` yields only the new tokens each time):
    their tokens, logprobs and versions in order, the last piece's finish reason and version."""
    import dataclasses

    last = outputs[-1]
    return dataclasses.replace(
        last, output_ids=[t for o in outputs for t in o.output_ids],
        output_logprobs=[x for o in outputs for x in o.output_logprobs],
        output_versions=[v for o in outputs for v in o.output_versions])


def assert_no_page_leaked(engine: Any) -> None:
    """A paged engine with nothing running holds no page but the prefix cache's, whose tree and
    the pool's counts agree; the cache is then dropped, so the next test starts on an empty pool
    (and a prompt it sends again is prefilled, not read from an earlier test's pages)."""
    engine.allocator.check()
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    if sched.cache is not None:
        sched.cache.check()
    assert engine.allocator.used_pages == sched.cached_pages
    sched.drop_cache()
    assert engine.allocator.used_pages == 0
