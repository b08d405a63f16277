"""Pause and resume cannot cross: a ``/continue_generation`` that lands while a
``/pause_generation`` waits for the step in flight runs after it, and the server's "paused" is
the engine's, so it never reports paused while the engine runs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.rollout_bridge.bridge_helpers import running_server


def test_a_resume_during_a_pause_leaves_the_server_running(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, lanes=1) as (addr, engine), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            url = f"http://{addr}"
            resumed = asyncio.Event()
            real_resume = engine.resume

            async def resume() -> None:
                resumed.set()
                await real_resume()

            engine.resume = resume
            async with engine._lanes[0].lock:  # a step in flight: the pause waits for it
                pause = asyncio.create_task(s.post(url + "/pause_generation", json={"mode": "abort"}))
                while engine.paused is None:
                    await asyncio.sleep(0.01)
                cont = asyncio.create_task(s.post(url + "/continue_generation", json={}))
                await resumed.wait()  # the continue reached the engine while the pause waits
            for task in (pause, cont):
                async with await task as r:
                    assert r.status == 200
            assert engine.paused is None
            async with s.get(url + "/get_server_info") as r:
                assert (await r.json())["internal_states"][0]["paused"] is False
            body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body) as r:
                assert len((await r.json())["output_ids"]) == 3

    asyncio.run(main())
