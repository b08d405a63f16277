"""Which servers the client sends requests to: a server that missed /continue_generation or a
weight push while it was out of reach is brought up to date (or kept out) before it is taken back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.rollout_bridge.bridge_helpers import running_server

CFG = ClientConfig(generate_timeout_s=60, control_timeout_s=10, all_down_wait_s=5, health_interval_s=3600)
SHORT = {"max_new_tokens": 4, "ignore_eos": True}


async def _server_state(addr: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(f"http://{addr}/get_server_info") as r:
        return (await r.json())["internal_states"][0]


def test_server_that_missed_continue_and_push_is_updated_before_readmission(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir) as (a, _), running_server(tiny_dir) as (b, _), \
                HttpRolloutClient([a, b], config=CFG) as client:
            late = client.servers[1]
            await client.pause()
            client.mark_down(late, "timed out")  # as a timed-out call would
            await client.update_weights_from_disk(str(tiny_dir), version=1)
            await client.continue_generation()
            assert (await _server_state(b))["paused"] and late.version == 0

            assert await client.check_health() == [True, True]
            assert late.version == 1 and client.in_rotation() == [f"http://{a}", f"http://{b}"]
            state = await _server_state(b)
            assert not state["paused"] and state["weight_version"] == "1"
            # every request is answered, whichever server it lands on
            results = await asyncio.wait_for(
                asyncio.gather(*(client.generate([3, 4, i], SHORT) for i in range(6))), 30)
            assert all(len(r.output_ids) == 4 for r in results)

    asyncio.run(main())


def test_paused_server_without_current_weights_stays_out(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir) as (a, _), running_server(tiny_dir) as (b, _), \
                HttpRolloutClient([a, b], config=CFG) as client:
            late = client.servers[1]
            await client.pause()
            client.mark_down(late, "timed out")
            await client.update_weight_version(1)  # no disk checkpoint to reload from
            await client.continue_generation()

            assert await client.check_health() == [True, True]
            assert client.in_rotation() == [f"http://{a}"] and late.paused
            assert (await _server_state(b))["paused"]  # not continued with old weights
            results = await asyncio.wait_for(
                asyncio.gather(*(client.generate([3, 4, i], SHORT) for i in range(4))), 30)
            assert all(r.resends == 0 for r in results)
            # the next push and continue bring it back
            await client.pause()
            await client.update_weight_version(2)
            await client.continue_generation()
            assert client.in_rotation() == [f"http://{a}", f"http://{b}"] and not late.paused

    asyncio.run(main())
