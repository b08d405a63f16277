"""Each answer's tokens are stamped with the policy version the reply itself proves, never a newer
one from the client's record: a server that went back to its launch weights behind the client's
back (a restart the health loop has not noticed yet) gets its tokens stamped with the launch
version, and the client's record of it drops at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.rollout_bridge.bridge_helpers import running_server

SP = {"max_new_tokens": 4, "ignore_eos": True}


def test_a_reply_that_proves_older_weights_is_stamped_with_them(tiny_dir: Path) -> None:
    cfg = ClientConfig(health_interval_s=3600, control_timeout_s=30)  # no version check meanwhile

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, _), \
                HttpRolloutClient([addr], config=cfg) as client:
            url = f"http://{addr}"
            await client.update_weight_version(3)  # the server confirms it keeps labels
            r = await client.generate([3, 4], SP)
            assert r.output_versions == [3] * 4
            # the server goes back to its launch weights' label, as a restart would
            async with aiohttp.ClientSession() as s, \
                    s.post(url + "/update_weight_version", json={"new_version": "default"}) as resp:
                assert resp.status == 200
            r = await client.generate([3, 5], SP)
            assert r.output_versions == [0] * 4  # "default" proves version 0, not the record's 3
            for _ in range(500):  # the reply triggered a version check: the record drops
                if client.server_versions()[url] == 0:
                    break
                await asyncio.sleep(0.02)
            assert client.server_versions()[url] == 0

    asyncio.run(main())
