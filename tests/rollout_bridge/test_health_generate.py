"""``/health_generate`` on a busy server: healthy while the engine makes progress, even when its
own probe cannot be served in time (here the waiting queue is full, so the probe is refused), as
SGLang counts any progress within the timeout; unhealthy only when nothing is generated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.rollout_bridge.bridge_helpers import running_server

LONG = {"max_new_tokens": 900, "ignore_eos": True}


def test_a_busy_server_that_makes_progress_is_healthy(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, num_slots=2, max_seq_len=1024, lanes=1, max_queued_requests=1,
                                  app_kw={}) as (addr, engine), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            url = f"http://{addr}"
            tasks = []
            for i in range(3):  # one by one, so that none is refused: both slots, then the queue
                tasks.append(asyncio.create_task(s.post(url + "/generate", json={"input_ids": [3, 4, i],
                                                                                 "sampling_params": LONG})))
                while engine.num_running + engine.num_waiting < i + 1 or (i < 2 and engine.num_running < i + 1):
                    await asyncio.sleep(0.01)
            assert engine.num_waiting == 1  # full: the probe is refused
            async with s.get(url + "/health_generate") as r:
                assert r.status == 200, await r.text()
            async with s.post(url + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            for t in tasks:
                (await t).close()

    asyncio.run(main())


def test_a_server_that_generates_nothing_is_unhealthy(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, lanes=1, app_kw={}) as (addr, engine), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            engine._run_step = _stuck  # every step fails: nothing is generated
            async with s.get(f"http://{addr}/health_generate") as r:
                assert r.status == 503, await r.text()
            del engine._run_step

    asyncio.run(main())


def _stuck(*args: object, **kwargs: object) -> None:
    raise RuntimeError("INTERNAL: injected step failure")
