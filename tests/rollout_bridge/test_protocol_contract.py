"""Our requests and replies validate against SGLang's own generated schema (sglang/api/v1/api_types.py),
and the client works against replies shaped exactly as a stock SGLang server sends them.

The schema comes from the pinned sglang wheel via ``scripts/fetch_sglang_schema.sh``; without it
these tests are skipped.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollout_bridge import client as client_module
from rollout_bridge import protocol as P
from rollout_bridge.client import IMMEDIATE_IDLE_RESENDS, ClientConfig, HttpRolloutClient, abort_backoff_s
from tests.rollout_bridge.bridge_helpers import ServerThread, serving_app

SCHEMA = Path(__file__).resolve().parents[2] / ".cache" / "sglang" / "api_types.py"


@pytest.fixture(scope="module")
def sgl() -> Any:
    if not SCHEMA.exists():
        pytest.fail(f"SGLang's schema is missing at {SCHEMA}: run scripts/fetch_sglang_schema.sh "
                    "(scripts/test.sh does) to check our protocol against it")
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


def test_our_replies_validate(sgl: Any, server: ServerThread) -> None:
    addr = server.addr

    async def main() -> None:
        url = f"http://{addr}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            body = {"input_ids": [5, 6, 7], "return_logprob": True, "rid": "c1",
                    "sampling_params": {"max_new_tokens": 5, "temperature": 0.5, "ignore_eos": True}}
            sgl.GenerateRequest.from_json_value(body)
            async with s.post(url + "/generate", json=body) as r:
                assert r.status == 200
                reply = sgl.GenerateResponse.from_json_value(await r.json())
            m = reply.meta_info
            assert m.id == "c1" and m.completion_tokens == 5 and m.weight_version == "default"
            assert isinstance(m.finish_reason, sgl.FinishLength) and m.finish_reason.length == 5
            assert [e.token_id for e in m.output_token_logprobs] == reply.output_ids
            assert [(w.version, w.start, w.end) for w in m.weight_versions] == [("default", 0, 5)]

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
                assert info.weight_version == "default" and info.is_generation
            async with s.get(url + "/get_server_info") as r:
                info = sgl.GetServerInfoResponse.from_json_value(await r.json())
                assert info.internal_states[0]["placement"] == {"mesh": None}  # one device
            async with s.post(url + "/abort_request", json={"rid": "nope"}) as r:
                sgl.AbortResponse.from_json_value(await r.json())
            async with s.get(url + "/health_generate") as r:
                assert r.status == 200

    asyncio.run(main())


CALLS = web.AppKey("calls", list)
SERVER = web.AppKey("server", dict)


def _stock_sglang(sgl: Any, abort_first: int, adopts_labels: bool = False) -> web.Application:
    """A stand-in for a stock SGLang server (no --weight-version flag, so its label starts as
    "default"). Every reply is built from SGLang's own schema types. The first /generate is aborted
    after ``abort_first`` tokens, as a pause with mode "abort" does. Without ``adopts_labels`` it
    ignores the weight_version of updates as an older SGLang does; with it, it reports the label
    of its last update in /get_model_info as SGLang >= 0.5 does, though its update reply still
    does not echo it. ``app[SERVER]`` holds its label and how many weight loads it will refuse."""
    calls: list[dict[str, Any]] = []
    server: dict[str, Any] = {"label": "default", "refuse_loads": 0}

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        req = sgl.GenerateRequest.from_json_value(body)  # the client's request is valid SGLang
        calls.append(body)
        n = req.sampling_params.max_new_tokens
        aborted = len(calls) == 1
        if aborted:
            n = abort_first
        last = req.input_ids[-1]
        ids = [(last + 1 + i) % 100 for i in range(n)]
        finish = (sgl.FinishAbort(message="Abort in waiting queue") if aborted else sgl.FinishLength(length=n))
        reply = sgl.GenerateResponse(text="x" * n, output_ids=ids, meta_info=sgl.GenerateMetaInfo(
            id=req.rid, prompt_tokens=len(req.input_ids), completion_tokens=n, finish_reason=finish,
            output_token_logprobs=[sgl.LogprobEntry(logprob=-0.5, token_id=t) for t in ids],
            e2e_latency=0.01, weight_version=server["label"]))  # SGLang: the label it serves now
        return web.json_response(reply.to_json_value())

    async def model_info(request: web.Request) -> web.Response:
        info = {"model_path": "m", "tokenizer_path": "m", "is_generation": True,
                "preferred_sampling_params": None, "weight_version": server["label"]}
        return web.json_response(sgl.GetModelInfoResponse.from_json_value(info).to_json_value())

    async def update_from_disk(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body)
        if server["refuse_loads"]:
            server["refuse_loads"] -= 1
            return web.json_response({"success": False, "message": f"Failed to load {body['model_path']}",
                                      "num_paused_requests": 0}, status=400)
        if adopts_labels and body.get("weight_version") is not None:
            server["label"] = body["weight_version"]
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app[CALLS] = calls
    app[SERVER] = server
    app.router.add_post("/generate", generate)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/health", ok)
    app.router.add_post("/update_weights_from_disk", update_from_disk)
    return app


def test_client_against_stock_sglang_replies(sgl: Any) -> None:
    """Label "default", no per-token versions, an aborted reply and its resume: the tokens carry
    the versions the client pushed, whatever the server calls them."""
    app = _stock_sglang(sgl, abort_first=3)

    async def main() -> None:
        async with serving_app(app) as addr:
            async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=10)) as client:
                r = await client.generate([5, 6, 7], {"max_new_tokens": 8, "temperature": 1.0})
                assert r.output_ids == [8, 9, 10] + [11, 12, 13, 14, 15] and r.resends == 1
                assert r.output_versions == [0] * 8 and r.output_logprobs == [-0.5] * 8
                assert r.finish_reason == {"type": "length", "length": 8}
                resend = app[CALLS][1]
                assert resend["input_ids"] == [5, 6, 7, 8, 9, 10]
                assert resend["sampling_params"]["max_new_tokens"] == 5
                await client.update_weights_from_disk("/ckpt/v1", version=1)
                assert client.server_versions() == {f"http://{addr}": 1}
                for _ in range(3):  # still "default", but it never took a label: not a restart
                    await client.check_versions()
                assert client.in_rotation() == [f"http://{addr}"]
                assert len(app[CALLS]) == 3  # two /generate, one weight update: no reload loop
                r = await client.generate([1, 2], {"max_new_tokens": 4})
                assert r.output_versions == [1] * 4
                assert await client.reported_versions() == {f"http://{addr}": "default"}

    asyncio.run(main())


def test_stock_sglang_that_takes_labels_and_restarts_leaves_rotation(sgl: Any) -> None:
    """SGLang >= 0.5 adopts the pushed label but its update reply does not say so; the client learns
    it from /get_model_info. After a restart (label back to "default") the server is out of
    rotation until it holds the current weights: a refused reload keeps it out until the next push,
    a reload of the last checkpoint puts it back at once."""
    app = _stock_sglang(sgl, abort_first=0, adopts_labels=True)
    state, calls = app[SERVER], app[CALLS]

    async def main() -> None:
        async with serving_app(app) as addr:
            url = f"http://{addr}"
            async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=10,
                                                                    health_interval_s=3600)) as client:
                await client.update_weights_from_disk("/ckpt/v1", version=1)
                await client.check_versions()
                assert state["label"] == "1" and client.in_rotation() == [url]
                state["label"], state["refuse_loads"] = "default", 1  # restarted; its reload fails
                await client.check_versions()
                assert [c["model_path"] for c in calls] == ["/ckpt/v1"] * 2  # the push, then a reload
                assert client.server_versions() == {url: 0} and client.in_rotation() == []
                await client.check_versions()  # still "default": stays out, no reload loop
                assert client.in_rotation() == [] and len(calls) == 2
                await client.update_weights_from_disk("/ckpt/v2", version=2)
                assert client.server_versions() == {url: 2} and client.in_rotation() == [url]
                await client.check_versions()
                state["label"] = "default"  # restarted again; this time the reload succeeds
                await client.check_versions()
                assert [c["model_path"] for c in calls[2:]] == ["/ckpt/v2"] * 2 and state["label"] == "2"
                assert client.server_versions() == {url: 2} and client.in_rotation() == [url]
                r = await client.generate([1, 2], {"max_new_tokens": 4})
                assert r.output_versions == [2] * 4

    asyncio.run(main())


def test_every_sglang_request_field_is_served_or_refused(sgl: Any, server: ServerThread) -> None:
    """Our /generate request has exactly SGLang's fields: none silently ignored, none invented."""
    assert set(P.GenerateReqInput.__struct_fields__) == set(sgl.GenerateRequest.__struct_fields__)
    implemented = set(P.GenerateReqInput.__struct_fields__) - set(P.UNSUPPORTED_AT_DEFAULT)
    assert implemented == {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                           "top_logprobs_num", "return_text_in_logprobs", "return_prompt_token_ids", "rid", "stream"}

    async def main() -> None:
        addr = server.addr
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [5, 6, 7], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                    "return_text_in_logprobs": True, "return_prompt_token_ids": True, "image_data": [],
                    "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}  # 3 tokens, always
            sgl.GenerateRequest.from_json_value(body)
            async with s.post(f"http://{addr}/generate", json=body) as r:
                reply = sgl.GenerateResponse.from_json_value(await r.json())
            m = reply.meta_info
            assert len(m.input_token_logprobs) == 3 and m.input_token_logprobs[0].logprob is None
            assert len(m.output_top_logprobs) == 3 and all(len(row) == 2 for row in m.output_top_logprobs)
            assert m.input_top_logprobs[0] is None and len(m.input_top_logprobs[1]) == 2
            assert reply.prompt_token_ids == [5, 6, 7]

    asyncio.run(main())


def _generate_only(generate: Any) -> web.Application:
    """A stand-in for stock SGLang that serves ``generate`` as /generate, with /health and
    /get_model_info answered as SGLang does (label "default")."""

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def model_info(request: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "tokenizer_path": "m", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": "default"})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", ok)
    app.router.add_get("/get_model_info", model_info)
    return app


def test_client_batches_against_stock_sglang_replies(sgl: Any) -> None:
    """A group asked with ``generate_many`` against a stand-in for stock SGLang's batch form: the
    request validates against SGLang's schema, the reply is a JSON list of SGLang's own reply type,
    in input order. The first call aborts the odd-numbered answers after 2 tokens (a pause):
    only those are re-sent, together, as prompt + tokens so far with the budget left."""
    calls: list[dict[str, Any]] = []

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        req = sgl.GenerateRequest.from_json_value(body)
        calls.append(body)
        assert isinstance(req.input_ids[0], list) and isinstance(req.rid, list)
        params = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(req.rid)
        replies = []
        for i, (ids, rid, sp) in enumerate(zip(req.input_ids, req.rid, params, strict=True)):
            aborted = len(calls) == 1 and i % 2 == 1
            n = 2 if aborted else sp.max_new_tokens
            out = [(ids[-1] + 1 + k) % 100 for k in range(n)]
            finish = sgl.FinishAbort(message="Abort before prefill") if aborted else sgl.FinishLength(length=n)
            replies.append(sgl.GenerateResponse(text="y" * n, output_ids=out, meta_info=sgl.GenerateMetaInfo(
                id=rid, prompt_tokens=len(ids), completion_tokens=n, finish_reason=finish,
                output_token_logprobs=[sgl.LogprobEntry(logprob=-0.25, token_id=t) for t in out],
                e2e_latency=0.01, weight_version="default")).to_json_value())
        return web.json_response(replies[::-1] if len(calls) == 2 else replies)  # ids, not order, match

    app = _generate_only(generate)

    async def main() -> None:
        async with serving_app(app) as addr:
            async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=10)) as client:
                res = await client.generate_many([[5, 6, 7]] * 4, {"max_new_tokens": 6, "temperature": 1.0},
                                                 rids=["q0", "q1", "q2", "q3"])
        assert len(calls) == 2
        assert calls[0]["rid"] == ["q0", "q1", "q2", "q3"] and calls[0]["input_ids"] == [[5, 6, 7]] * 4
        assert calls[1]["rid"] == ["q1-r1", "q3-r1"] and calls[1]["input_ids"] == [[5, 6, 7, 8, 9]] * 2
        assert [sp["max_new_tokens"] for sp in calls[1]["sampling_params"]] == [4, 4]
        assert [r.rid for r in res] == ["q0", "q1", "q2", "q3"]
        assert [r.resends for r in res] == [0, 1, 0, 1]
        assert res[0].output_ids == [8, 9, 10, 11, 12, 13]
        assert res[1].output_ids == [8, 9] + [10, 11, 12, 13] and res[1].text == "yy" + "yyyy"
        assert all(r.output_logprobs == [-0.25] * 6 and r.output_versions == [0] * 6 for r in res)
        assert all(r.finish_reason == {"type": "length", "length": 6} for r in res)

    asyncio.run(main())


def test_a_group_aborted_while_queued_is_resent_at_once_then_backed_off(sgl: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause aborts the requests still in SGLang's waiting queue as well as the running ones,
    and they come back with no token ("Abort in waiting queue"). The first such aborts in a row are
    re-sent at once; a server that keeps aborting without progress is then backed off, 0.05 s and
    doubling. The stand-in answers a group only at its sixth /generate. What is checked is the
    waits the client asks for between re-sends (each recorded with the /generate calls before
    it), not a clock."""
    arrived: list[float] = []
    empty = IMMEDIATE_IDLE_RESENDS + 3
    waits: list[tuple[int, float]] = []
    real_sleep = client_module.sleep_or_wake

    async def recorded(wake: asyncio.Event, seconds: float) -> None:
        waits.append((len(arrived), seconds))
        await real_sleep(wake, seconds)

    monkeypatch.setattr(client_module, "sleep_or_wake", recorded)

    async def generate(request: web.Request) -> web.Response:
        arrived.append(time.monotonic())
        req = sgl.GenerateRequest.from_json_value(await request.json())
        replies = []
        for ids, rid, sp in zip(req.input_ids, req.rid, req.sampling_params, strict=True):
            n = 0 if len(arrived) <= empty else sp.max_new_tokens
            out = [(ids[-1] + 1 + k) % 100 for k in range(n)]
            finish = sgl.FinishAbort(message="Abort in waiting queue") if n == 0 else sgl.FinishLength(length=n)
            replies.append(sgl.GenerateResponse(text="z" * n, output_ids=out, meta_info=sgl.GenerateMetaInfo(
                id=rid, prompt_tokens=len(ids), completion_tokens=n, finish_reason=finish,
                output_token_logprobs=[sgl.LogprobEntry(logprob=-0.5, token_id=t) for t in out],
                e2e_latency=0.01, weight_version="default")).to_json_value())
        return web.json_response(replies)

    app = _generate_only(generate)

    async def main() -> None:
        async with serving_app(app) as addr:
            async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=10)) as client:
                res = await client.generate_many([[5, 6, 7]] * 4, {"max_new_tokens": 3}, rids=["a", "b", "c", "d"])
        assert [r.output_ids for r in res] == [[8, 9, 10]] * 4 and [r.resends for r in res] == [empty] * 4
        assert len(arrived) == empty + 1
        # Re-sent at once after the first aborts (the backoff this replaces waited 0.1 s before the
        # first re-send, 0.2 s before the second), then after a wait that doubles.
        assert waits == [(idle, abort_backoff_s(idle)) for idle in range(IMMEDIATE_IDLE_RESENDS + 1, empty + 1)], waits
        assert all(w > 0 for _, w in waits)
        assert [abort_backoff_s(i) for i in (3, 4, 5)] == [0.05, 0.1, 0.2] and abort_backoff_s(50) == 1.0

    asyncio.run(main())
