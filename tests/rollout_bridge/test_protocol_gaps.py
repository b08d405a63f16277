"""Small differences from SGLang 0.5 closed: ``/abort_request`` with an empty rid is a logged
no-op answered 200 (not a 400), and the weight-update replies carry ``num_paused_requests``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.rollout_bridge.bridge_helpers import running_server


def test_empty_rid_abort_is_a_no_op_and_update_replies_carry_num_paused_requests(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, app_kw={"weight_roots": [tiny_dir.parent]}) as (addr, _), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            url = f"http://{addr}"
            async with s.post(url + "/abort_request", json={"rid": ""}) as r:
                assert r.status == 200 and (await r.json())["num_aborted"] == 0
            async with s.post(url + "/update_weights_from_disk", json={"model_path": str(tiny_dir)}) as r:
                reply = await r.json()
                assert r.status == 200 and reply["success"] and reply["num_paused_requests"] == 0

    asyncio.run(main())
