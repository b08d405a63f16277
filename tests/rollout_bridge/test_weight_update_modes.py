"""The two ways a weight update meets the requests in flight, on one server for the module:
``swap`` (default) puts the new weights in between two steps and the answer goes on under them,
its reply naming both versions' spans; ``drain`` (SGLang's model-update lock) holds new requests,
waits for the ones in flight to finish under the old weights, then swaps (real HTTP, real
safetensors buckets)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from areal_jax.models import iter_hf_tensors, load_pretrained
from rollout_bridge.client import ClientConfig, HttpRolloutClient
from rollout_bridge.streamer import HttpBucketSink
from tests.rollout_bridge.bridge_helpers import ServerThread

LONG = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(tiny_dir, max_seq_len=256) as srv:
        yield srv


async def _generate(s: aiohttp.ClientSession, addr: str, ids: list[int], sp: dict[str, Any]) -> dict[str, Any]:
    async with s.post(f"http://{addr}/generate", json={"input_ids": ids, "sampling_params": sp}) as r:
        assert r.status == 200
        return await r.json()


async def _until(cond: Any) -> None:
    while not cond():
        await asyncio.sleep(0.005)


def _spans(reply: dict[str, Any]) -> list[tuple[str, int]]:
    return [(w["version"], w["end"] - w["start"]) for w in reply["meta_info"]["weight_versions"]]


@pytest.mark.parametrize("mode", ["swap", "drain"])
def test_an_update_swaps_between_steps_or_drains(server: ServerThread, tiny_dir: Path, mode: str) -> None:
    server.state.weight_update_mode = mode
    engine, addr = server.engine, server.addr
    version = {"swap": 1, "drain": 2}[mode]
    label = str(version)

    async def main() -> None:
        async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=60)) as client, \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
            old = (await (await s.get(f"http://{addr}/get_model_info")).json())["weight_version"]
            sink = HttpBucketSink(client, bucket_bytes=1 << 20)
            await sink.push(version, iter_hf_tensors(load_pretrained(tiny_dir), "float32", hf_layout=False),
                            hold=True)  # built beforehand: the commit is only the swap
            tokens = engine.stats["decode_tokens"]
            long = asyncio.create_task(_generate(s, addr, [3, 4, 5], LONG))
            await _until(lambda: engine.stats["decode_tokens"] >= tokens + 5)  # it is generating
            commit = asyncio.create_task(sink.commit(version))
            if mode == "drain":
                await _until(lambda: server.state.draining)
                late = asyncio.create_task(_generate(s, addr, [6, 7], {"max_new_tokens": 4, "ignore_eos": True}))
                await asyncio.sleep(0)
            reply = await long
            await commit
            if mode == "swap":  # both versions in one answer, old first
                spans = _spans(reply)
                assert [v for v, _ in spans] == [old, label] and sum(n for _, n in spans) == 200, spans
            else:  # the update waited for it; the request sent meanwhile waited for the update
                assert _spans(reply) == [(old, 200)]
                assert _spans(await late) == [(label, 4)]
                assert server.state.generating == 0 and not server.state.draining
            info = await (await s.get(f"http://{addr}/get_server_info")).json()
            assert info["weight_update_mode"] == mode and info["internal_states"][0]["weight_version"] == label

    asyncio.run(main())
