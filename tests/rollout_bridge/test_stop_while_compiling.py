"""A server stopped while it compiles its step shapes at start-up (SIGTERM runs the same
``runner.cleanup``) stops compiling after the shape in hand: cleanup returns only once the
compiling thread is done, so the process can exit, rather than after every shape."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.models import load_pretrained
from rollout_bridge.server import build_app, start_server
from rollout_bridge.state import STATE


def test_stopping_during_the_start_up_compile_stops_it(tiny_dir: Path) -> None:
    # 16 slots: three shapes to compile (a mixed step of four prefill blocks, decode calls of 8 and 16 rows)
    cfg = EngineConfig(num_slots=16, max_seq_len=64, chunked_prefill_size=64, max_prefill_batch=2, lanes=1, seed=0)
    engine = Engine(load_pretrained(tiny_dir), cfg)
    total = len(engine.step_shapes())
    assert total > 2
    compiling = threading.Event()
    real = engine.warmup

    def warmup(*args: object, **kwargs: object) -> int:
        compiling.set()
        return real(*args, **kwargs)

    engine.warmup = warmup

    async def main() -> dict:
        app = build_app(engine, warmup=True)
        runner, _ = await start_server(app, "127.0.0.1", 0)
        await asyncio.to_thread(compiling.wait)  # the start-up compile is under way
        await runner.cleanup()
        return app[STATE].warmup

    warmup = asyncio.run(main())
    assert warmup.get("stopped") and warmup["shapes"] < total, warmup
    assert not engine.alive
