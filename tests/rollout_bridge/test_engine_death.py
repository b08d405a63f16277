"""A server whose engine died (a lane that failed a step and then could not re-allocate its
cache) is unhealthy, fails its requests at once, and exits non-zero so that a supervisor
restarts it. The fault is injected into a real engine behind a real server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from rollout_bridge.serve import DEAD_ENGINE_EXIT_CODE, build, parser, serve_app
from tests.ports import free_port
from tests.rollout_bridge.bridge_helpers import running_server

TIMEOUT = aiohttp.ClientTimeout(total=60)
BODY = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}


def _oom(*args: object, **kwargs: object) -> None:
    raise MemoryError("RESOURCE_EXHAUSTED: injected")


def _kill_on_next_step(engine: object) -> None:
    engine._run_step = engine._fresh_cache = _oom  # the step fails, then its fresh cache too


def test_a_dead_engine_is_unhealthy_and_fails_requests_at_once(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, num_slots=2, max_seq_len=64, lanes=1) as (addr, engine), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"http://{addr}"
            async with s.get(url + "/health") as r:
                assert r.status == 200
            _kill_on_next_step(engine)
            async with s.post(url + "/generate", json=BODY) as r:
                assert r.status == 500 and "RESOURCE_EXHAUSTED" in (await r.json())["error"]["message"]
            await engine.wait_dead()
            for path in ("/health", "/health_generate"):
                async with s.get(url + path) as r:
                    assert r.status == 503, path
                    assert "engine dead" in (await r.json())["error"]["message"]
            async with s.post(url + "/generate", json=BODY) as r:  # refused, not queued for 1 hour
                assert r.status == 500 and "engine is dead" in (await r.json())["error"]["message"]

    asyncio.run(main())


def test_serve_exits_non_zero_when_its_engine_dies(tiny_dir: Path) -> None:
    port = free_port()
    args = parser().parse_args(["--model-path", str(tiny_dir), "--port", str(port), "--max-running-requests", "2",
                                "--context-length", "64", "--lanes", "1", "--skip-server-warmup"])

    async def main() -> int:
        app, engine = build(args)
        served = asyncio.create_task(serve_app(app, engine, args))
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            while True:  # listening once /health answers
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    assert not served.done()
                    await asyncio.sleep(0.05)
            _kill_on_next_step(engine)
            async with s.post(url + "/generate", json=BODY) as r:
                assert r.status == 500
        return await asyncio.wait_for(served, 60)

    assert asyncio.run(main()) == DEAD_ENGINE_EXIT_CODE != 0
