"""Helpers of the rollout_bridge tests: servers on free local ports and reference decoding."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

from areal_jax.models import load_pretrained, load_tokenizer


@contextlib.asynccontextmanager
async def running_server(model_dir: Path, *, api_key: str | None = None, num_slots: int = 8,
                         max_seq_len: int = 128, version: int = 0, port: int = 0,
                         shutdown_timeout: float = 10.0, app_kw: dict[str, Any] | None = None,
                         **engine_kw: Any) -> AsyncIterator[tuple[str, Any]]:
    """An embedded server on 127.0.0.1:<port, free if 0>; yields (address, engine). ``engine_kw``
    go to ``EngineConfig`` (``seed``, ``max_queued_requests``, ...), ``app_kw`` to ``build_app``."""
    from areal_jax.inference.engine import Engine, EngineConfig
    from rollout_bridge.server import build_app, start_server

    model = load_pretrained(model_dir, fuse_projections=True)  # as `areal-jax serve` loads it
    engine = Engine(model, EngineConfig(num_slots=num_slots, max_seq_len=max_seq_len, **engine_kw),
                    eos_token_ids=model.config.eos_token_ids, version=version)
    app = build_app(engine, load_tokenizer(model_dir), api_key, model_path=str(model_dir), **(app_kw or {}))
    runner, port = await start_server(app, "127.0.0.1", port, shutdown_timeout=shutdown_timeout)
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_app(app: web.Application) -> AsyncIterator[str]:
    """``app`` on a free port of 127.0.0.1; yields its address."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # noqa: SLF001
    finally:
        await runner.cleanup()
