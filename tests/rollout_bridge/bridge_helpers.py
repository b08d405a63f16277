"""Helpers of the rollout_bridge tests: servers on free local ports (one per test, or one per
module in a thread of its own) and reference decoding."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from areal_jax.models import load_pretrained, load_tokenizer

T = TypeVar("T")


def build_server_app(model_dir: Path, *, api_key: str | None = None, num_slots: int = 8, max_seq_len: int = 128,
                     version: int = 0, app_kw: dict[str, Any] | None = None, tokenizer: Any = None,
                     **engine_kw: Any) -> tuple[web.Application, Any]:
    """The embedded server's app over a fresh engine of ``model_dir``'s model: (app, engine)."""
    from areal_jax.inference.engine import Engine, EngineConfig
    from rollout_bridge.server import build_app

    model = load_pretrained(model_dir, fuse_projections=True)  # as `areal-jax serve` loads it
    engine = Engine(model, EngineConfig(num_slots=num_slots, max_seq_len=max_seq_len, **engine_kw),
                    eos_token_ids=model.config.eos_token_ids, version=version)
    app = build_app(engine, tokenizer if tokenizer is not None else load_tokenizer(model_dir), api_key,
                    model_path=str(model_dir), **(app_kw or {}))
    return app, engine


@contextlib.asynccontextmanager
async def running_server(model_dir: Path, *, port: int = 0, shutdown_timeout: float = 10.0,
                         **kw: Any) -> AsyncIterator[tuple[str, Any]]:
    """An embedded server on 127.0.0.1:<port, free if 0>; yields (address, engine). ``kw`` go to
    ``build_server_app``: ``engine_kw`` to ``EngineConfig`` (``seed``, ``max_queued_requests``,
    ...), ``app_kw`` to ``build_app``; ``tokenizer`` replaces the checkpoint's."""
    from rollout_bridge.server import start_server

    app, engine = build_server_app(model_dir, **kw)
    runner, port = await start_server(app, "127.0.0.1", port, shutdown_timeout=shutdown_timeout)
    try:
        yield f"127.0.0.1:{port}", engine
    finally:
        await runner.cleanup()


class ServerThread:
    """An embedded server with its own event loop in a thread, for a module's tests to share
    (each test runs its own loop with ``asyncio.run``). ``run(coro)`` runs a coroutine on the
    server's loop (to reach the engine); ``state`` is the app's ``ServerState``."""

    def __init__(self, model_dir: Path, **kw: Any) -> None:
        self.model_dir, self.kw = model_dir, kw
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.addr, self.engine, self.state, self._runner = "", None, None, None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> ServerThread:
        from rollout_bridge.server import start_server
        from rollout_bridge.state import STATE

        self.thread.start()

        async def start() -> None:
            app, self.engine = build_server_app(self.model_dir, **self.kw)
            self.state = app[STATE]
            self._runner, port = await start_server(app, "127.0.0.1", 0)
            self.addr = f"127.0.0.1:{port}"

        self.run(start())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._runner is not None:
                self.run(self._runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


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
