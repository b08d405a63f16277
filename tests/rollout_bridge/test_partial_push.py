"""A bucketed weight transfer commits a version only when every tensor of the model arrived: a
last bucket that leaves tensors out is refused by name and the old weights and label keep
serving, unless the transfer says it is partial (``partial=true``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np

from areal_jax.models import iter_hf_tensors, load_pretrained
from areal_jax.models.safetensors_codec import encode_tensor_bucket
from tests.rollout_bridge.bridge_helpers import running_server

HDR = {"Content-Type": "application/octet-stream"}


def test_a_transfer_missing_tensors_is_not_served(tiny_dir: Path) -> None:
    tensors = {name: np.asarray(arr) * 2 for name, arr in iter_hf_tensors(load_pretrained(tiny_dir))}
    name = next(iter(tensors))

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            url = f"http://{addr}"

            async def push(tid: str, version: str, **extra: str) -> tuple[int, dict]:
                q = {"weight_version": version, "transfer_id": tid, "bucket": "0", "last": "true", **extra}
                async with s.post(url + "/update_weights_from_tensor", params=q, headers=HDR,
                                  data=encode_tensor_bucket({name: tensors[name]})) as r:
                    return r.status, await r.json()

            status, reply = await push("t1", "v7")  # 1 of the model's tensors
            assert status == 400 and reply["success"] is False, reply
            assert f"{len(tensors) - 1} tensors missing" in reply["message"] and "partial" in reply["message"]
            assert engine.version == 0
            async with s.get(url + "/get_weight_version") as r:
                assert (await r.json())["weight_version"] == "default"

            status, reply = await push("t2", "v8", partial="true")  # said to be partial: served
            assert status == 200 and reply["success"] is True, reply
            assert engine.version == 1 and reply["weight_version"] == "v8"

    asyncio.run(main())
