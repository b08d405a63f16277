"""``HttpRolloutClient.abort(rid)`` is never lost: an abort that lands while the answer waits
between two attempts (an error back-off here) ends it at once, and an abort of a rid that is not
being generated is not kept against a later request with that rid. A real server, whose engine
step is made to fail for the first case."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.rollout_bridge.bridge_helpers import running_server

SP = {"max_new_tokens": 6, "ignore_eos": True}


def test_an_abort_during_a_back_off_ends_the_answer_at_once(tiny_dir: Path) -> None:
    cfg = ClientConfig(error_backoff_s=3600, max_error_resends=3, health_interval_s=3600)

    def failing_step(*args: object, **kwargs: object) -> None:
        raise RuntimeError("INTERNAL: injected step failure")

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, lanes=1) as (addr, engine), \
                HttpRolloutClient([addr], config=cfg) as client:
            engine._run_step = failing_step
            task = asyncio.create_task(client.generate([3, 4], SP, rid="x"))
            while "x" not in client._answers or client._answers["x"].attempt < 1 or client.servers[0].inflight:
                await asyncio.sleep(0.01)  # its first attempt failed: backing off for an hour
            await client.abort("x")
            r = await asyncio.wait_for(task, 60)
            assert r.finish_reason["type"] == "abort" and r.output_ids == [] and r.resends == 0
            assert client._answers == {}

    asyncio.run(main())


def test_an_abort_of_a_rid_not_being_generated_is_not_kept(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine), \
                HttpRolloutClient([addr], config=ClientConfig(health_interval_s=3600)) as client:
            await client.abort("y")  # nothing to stop: ignored
            # The server paused by another hand (this client sends nothing while it has the
            # servers paused itself): the request reaches it and waits there.
            await engine.pause("in_place")
            task = asyncio.create_task(client.generate([3, 4], SP, rid="y"))
            while not engine.num_waiting:  # sent: it waits on the paused server
                await asyncio.sleep(0.01)
            await client.pause()  # aborts it there: a pause, so the client re-sends it
            await client.continue_generation()
            r = await asyncio.wait_for(task, 60)
            assert len(r.output_ids) == 6 and r.finish_reason["type"] == "length" and r.resends == 1

    asyncio.run(main())
