"""Small differences from SGLang 0.5 closed, on one server for the module: ``/abort_request``
with an empty rid is a logged no-op answered 200; weight-update replies carry
``num_paused_requests``; prompt + ``max_new_tokens`` must stay below the context length (SGLang's
rule and message); a batch with ``stream`` streams its inputs interleaved with their ``index``; the
JSON forms of ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` are checked
for SGLang's shape and refused with a 400 saying why (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.rollout_bridge.bridge_helpers import ServerThread

CONTEXT = 64
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(tiny_dir, max_seq_len=CONTEXT, app_kw={"weight_roots": [tiny_dir.parent]}) as srv:
        yield srv


async def _post(s: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json()


def test_empty_rid_abort_is_a_no_op_and_update_replies_carry_num_paused_requests(server: ServerThread,
                                                                                  tiny_dir: Path) -> None:
    async def main() -> None:
        url = f"http://{server.addr}"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            status, reply = await _post(s, url + "/abort_request", {"rid": ""})
            assert status == 200 and reply["num_aborted"] == 0
            status, reply = await _post(s, url + "/update_weights_from_disk", {"model_path": str(tiny_dir)})
            assert status == 200 and reply["success"] and reply["num_paused_requests"] == 0

    asyncio.run(main())


def test_prompt_and_max_new_tokens_stay_below_the_context_length(server: ServerThread) -> None:
    """SGLang rejects prompt + max_new_tokens >= context length (it accepted == before)."""

    async def main() -> None:
        url = f"http://{server.addr}/generate"
        prompt = [5] * 10
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            status, reply = await _post(s, url, {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": CONTEXT - 10, "ignore_eos": True}})
            assert status == 400
            msg = reply["error"]["message"]
            assert msg.startswith("sampling_params.max_new_tokens: Requested token count exceeds the model's "
                                  f"maximum context length of {CONTEXT} tokens. You requested a total of "
                                  f"{CONTEXT} tokens: 10 tokens from the input messages and {CONTEXT - 10}")
            assert f"at most {CONTEXT - 11}" in msg
            status, reply = await _post(s, url, {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": CONTEXT - 11, "ignore_eos": True}})
            assert status == 200 and len(reply["output_ids"]) == CONTEXT - 11
            status, reply = await _post(s, url, {"input_ids": [5] * CONTEXT, "sampling_params": {"max_new_tokens": 0}})
            assert status == 400 and f"The input ({CONTEXT} tokens) is longer than the model's context length " \
                f"({CONTEXT} tokens)" in reply["error"]["message"]
            # A chat without max_tokens: what the context leaves, one short of it (it asked for all of it,
            # which is now refused)
            status, reply = await _post(s, f"http://{server.addr}/v1/chat/completions", {
                "messages": [{"role": "user", "content": "1+1"}], "ignore_eos": True, "temperature": 0})
            usage = reply["usage"]
            assert status == 200 and usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"] - 1

    asyncio.run(main())


def test_a_batch_streams_its_inputs_interleaved_with_their_index(server: ServerThread) -> None:
    server.state.incremental_streaming_output = True
    body = {"input_ids": [[3, 4, 5], [6, 7], [8, 9, 10, 11]], "rid": ["b0", "b1", "b2"],
            "sampling_params": [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (12, 5, 20)]}

    async def main() -> None:
        url = f"http://{server.addr}/generate"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            status, whole = await _post(s, url, body)
            assert status == 200
            async with s.post(url, json={**body, "stream": True, "rid": ["s0", "s1", "s2"]}) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                events = [e for e in (await r.read()).decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        parts = [json.loads(e[6:]) for e in events[:-1]]
        assert {p["index"] for p in parts} == {0, 1, 2}
        assert [p["index"] for p in parts] != sorted(p["index"] for p in parts)  # interleaved, not one after another
        for i in range(3):
            mine = [p for p in parts if p["index"] == i]
            assert {p["meta_info"]["id"] for p in mine} == {f"s{i}"}
            assert sum((p["output_ids"] for p in mine), []) == whole[i]["output_ids"]
            assert "".join(p["text"] for p in mine) == whole[i]["text"]
            assert mine[-1]["meta_info"]["finish_reason"] == whole[i]["meta_info"]["finish_reason"]
            assert all(p["meta_info"]["finish_reason"] is None for p in mine[:-1])

    asyncio.run(main())


def test_json_weight_forms_are_checked_and_refused_saying_why(server: ServerThread) -> None:
    async def main() -> None:
        url = f"http://{server.addr}"
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            before = await (await s.get(url + "/get_model_info")).json()
            status, reply = await _post(s, url + "/update_weights_from_tensor", {
                "serialized_named_tensors": ["gASV..."], "weight_version": "v9", "flush_cache": True})
            assert status == 400 and reply["success"] is False
            assert "unpickles nothing" in reply["message"] and "application/octet-stream" in reply["message"]
            status, reply = await _post(s, url + "/update_weights_from_tensor", {"named_tensors": []})
            assert status == 400 and "named_tensors" in reply["error"]["message"]  # not SGLang's shape
            status, reply = await _post(s, url + "/update_weights_from_distributed", {
                "names": ["lm_head.weight"], "dtypes": ["bfloat16"], "shapes": [[128, 64]], "weight_version": "v9"})
            assert status == 400 and reply["success"] is False and "NCCL" in reply["message"]
            status, reply = await _post(s, url + "/update_weights_from_distributed", {"names": ["x"]})
            assert status == 400 and "dtypes" in reply["error"]["message"]
            status, reply = await _post(s, url + "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2})
            assert status == 400 and "NCCL" in reply["message"]
            after = await (await s.get(url + "/get_model_info")).json()
            assert after["weight_version"] == before["weight_version"]  # nothing changed

    asyncio.run(main())
