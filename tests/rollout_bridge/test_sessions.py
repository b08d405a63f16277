"""An agent run's turns over two servers: requests naming one session go to one server, whose
prefix cache then holds the turns before; requests without one go round-robin."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.rollout_bridge.bridge_helpers import running_server

CFG = ClientConfig(generate_timeout_s=60, control_timeout_s=10, all_down_wait_s=5, health_interval_s=3600)
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def test_a_sessions_turns_go_to_one_server_and_read_its_cache(tiny_dir: Path) -> None:
    async def main() -> None:
        kw = {"kv_cache": "paged", "page_size": 16, "max_total_tokens": 2048}
        async with running_server(tiny_dir, **kw) as (a, ea), running_server(tiny_dir, **kw) as (b, eb), \
                HttpRolloutClient([a, b], config=CFG) as client:
            engines = (ea, eb)
            prompt = [5 + i % 90 for i in range(40)]
            # without a session, two requests go round-robin: one to each server
            await client.generate(prompt, GREEDY)
            await client.generate(prompt, GREEDY)
            assert [e.stats["finished_requests"] for e in engines] == [1, 1]
            for e in engines:
                assert await e.flush_cache()
            # three turns of one agent run, each the last one's tokens and a tool's reply
            turn = prompt
            for _ in range(3):
                out = await client.generate(turn, GREEDY, session="run-1")
                turn = turn + out.output_ids + [7, 8, 9, 10, 11]
            served = [e.stats["finished_requests"] - 1 for e in engines]
            assert sorted(served) == [0, 3], served
            home = engines[served.index(3)]
            # turns 2 and 3 read the whole pages the turn before wrote (all its tokens but the
            # last): 47 tokens -> 2 pages of 16, then 60 -> 3 pages
            assert home.stats["cached_prompt_tokens"] == 32 + 48
            # another session starts round-robin, on the other server
            await client.generate(prompt, GREEDY, session="run-2")
            assert sorted(e.stats["finished_requests"] for e in engines) == [2, 4]

    asyncio.run(main())
