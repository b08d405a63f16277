"""Helpers of the rollout_bridge tests: servers on free local ports and reference decoding."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from areal_jax.models import load_pretrained, load_tokenizer
from areal_jax.models.logprobs import logprobs_from_logits


@contextlib.asynccontextmanager
async def running_server(model_dir: Path, *, api_key: str | None = None, num_slots: int = 8,
                         max_seq_len: int = 128, version: int = 0,
                         shutdown_timeout: float = 10.0) -> AsyncIterator[tuple[str, Any]]:
    """An embedded server on 127.0.0.1:<free port>; yields (address, engine)."""
    from areal_jax.inference.engine import Engine, EngineConfig
    from rollout_bridge.server import build_app, start_server

    model = load_pretrained(model_dir)
    engine = Engine(model, EngineConfig(num_slots=num_slots, max_seq_len=max_seq_len),
                    eos_token_ids=model.config.eos_token_ids, version=version)
    app = build_app(engine, load_tokenizer(model_dir), api_key, model_path=str(model_dir))
    runner, port = await start_server(app, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout)
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        await runner.cleanup()


def full_forward_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> np.ndarray:
    """Logprobs of ``output`` after ``prompt`` from one full forward pass (the reference)."""
    ids = jnp.asarray([prompt + output])
    logits = model(ids)[0, len(prompt) - 1: len(prompt) + len(output) - 1]
    return np.asarray(logprobs_from_logits(logits, jnp.asarray(output), temperature))


def greedy_reference(model: Any, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """Greedy decoding by a full forward pass per token (no KV cache)."""
    from flax import nnx

    width = 1 << (len(prompt) + n).bit_length()  # one padded shape: causal attention ignores the tail
    forward = nnx.jit(lambda m, ids: m(ids))
    out: list[int] = []
    for _ in range(n):
        seq = prompt + out
        logits = forward(model, jnp.asarray([seq + [0] * (width - len(seq))]))[0, len(seq) - 1]
        tok = int(jnp.argmax(logits))
        out.append(tok)
        if tok in eos:
            break
    return out
