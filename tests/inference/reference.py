"""Plain reference computations the engine is checked against: greedy decoding and logprobs
from the full forward pass, plus a sharpened tiny checkpoint."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
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


def prompts(lengths: list[int], seed: int = 0, vocab: int = 128) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, n).tolist() for n in lengths]
