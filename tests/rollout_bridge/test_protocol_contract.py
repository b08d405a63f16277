"""Our requests and replies validate against SGLang's own generated schema (sglang/api/v1/api_types.py).

The schema comes from the pinned sglang wheel via ``scripts/fetch_sglang_schema.sh``; without it
this test is skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rollout_bridge import protocol as P
from tests.rollout_bridge.bridge_helpers import running_server

SCHEMA = Path(__file__).resolve().parents[2] / ".cache" / "sglang" / "api_types.py"


@pytest.fixture(scope="module")
def sgl() -> Any:
    if not SCHEMA.exists():
        pytest.skip(f"SGLang schema not fetched: run scripts/fetch_sglang_schema.sh (wants {SCHEMA})")
    spec = importlib.util.spec_from_file_location("sglang_api_types", SCHEMA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_our_requests_validate(sgl: Any) -> None:
    req = P.GenerateReqInput(input_ids=[1, 2, 3], rid="x", return_logprob=True,
                             sampling_params=P.SamplingParams(max_new_tokens=5, temperature=0.7, top_k=20,
                                                              stop_token_ids=[2], ignore_eos=True))
    got = sgl.GenerateRequest.from_json_value(json.loads(P.encode(req)))
    assert got.input_ids == [1, 2, 3] and got.sampling_params.top_k == 20
    sgl.AbortRequest.from_json_value(json.loads(P.encode(P.AbortReqInput(rid="x"))))
    # the schema rejects unknown sampling parameters, as our server does
    with pytest.raises(sgl.JsonContractError, match="tempurature"):
        sgl.SamplingParams.from_json_value({"tempurature": 1.0})
    # defaults agree (top_k: SGLang's schema spells "all" as 1 << 30, we accept it and -1)
    ours, theirs = P.SamplingParams(), sgl.SamplingParams()
    for name in ("max_new_tokens", "temperature", "top_p", "ignore_eos", "n", "min_p", "skip_special_tokens"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert theirs.top_k == P.CONTEXT_UNLIMITED_TOP_K


def test_our_replies_validate(sgl: Any, tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir) as (addr, _):
            url = f"http://{addr}"
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                body = {"input_ids": [5, 6, 7], "return_logprob": True, "rid": "c1",
                        "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "ignore_eos": True}}
                sgl.GenerateRequest.from_json_value(body)
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200
                    reply = sgl.GenerateResponse.from_json_value(await r.json())
                m = reply.meta_info
                assert m.id == "c1" and m.completion_tokens == 5 and m.weight_version == "0"
                assert isinstance(m.finish_reason, sgl.FinishLength) and m.finish_reason.length == 5
                assert [e.token_id for e in m.output_token_logprobs] == reply.output_ids
                assert [(w.version, w.start, w.end) for w in m.weight_versions] == [("0", 0, 5)]

                async with s.post(url + "/generate", json={**body, "stream": True, "rid": "c2"}) as r:
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    raw = (await r.read()).decode()
                events = [e for e in raw.split("\n\n") if e]
                assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
                parts = [sgl.GenerateResponse.from_json_value(json.loads(e[6:])) for e in events[:-1]]
                assert len(parts[-1].output_ids) == 5 and parts[-1].meta_info.finish_reason is not None
                lens = [len(p.output_ids) for p in parts]
                assert lens == sorted(lens)  # cumulative

                async with s.get(url + "/get_model_info") as r:
                    info = sgl.GetModelInfoResponse.from_json_value(await r.json())
                    assert info.weight_version == "0" and info.is_generation
                async with s.get(url + "/get_server_info") as r:
                    sgl.GetServerInfoResponse.from_json_value(await r.json())
                async with s.post(url + "/abort_request", json={"rid": "nope"}) as r:
                    sgl.AbortResponse.from_json_value(await r.json())
                async with s.get(url + "/health_generate") as r:
                    assert r.status == 200

    asyncio.run(main())
