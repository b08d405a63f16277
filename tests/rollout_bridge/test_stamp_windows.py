"""No token is stamped with a version other than the weights that produced it, in the two
windows a review found against servers that report no per-token versions (stock SGLang):

(a) a request in flight when a pause lands reaches the server after it, is held there, and runs
    after the continue under the weights pushed meanwhile;
(b) ``update_weights_from_disk(abort_all_requests=True)`` without a pause: the aborted answers
    are re-sent at once, wait for the load on the server and run under the new weights.

Both were stamped with the version the client recorded when it sent them: one version too old.
The stand-in behaves as SGLang does (a paused server holds requests that arrive; a load waits
for the requests in flight and holds new ones; ``weight_version`` in a reply is the label it
serves when it answers), with events for the test to order arrivals (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.rollout_bridge.bridge_helpers import serving_app

N = 4
FAKE = web.AppKey("fake", Any)


class FakeSGLang:
    """The stand-in's state: its label, pause, the requests it runs, and gates for the test."""

    def __init__(self, adopts_labels: bool) -> None:
        self.adopts_labels = adopts_labels
        self.label = "default"
        self.paused = False
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.loaded = asyncio.Event()  # set while no load is in progress
        self.loaded.set()
        self.load_gate = asyncio.Event()
        self.load_gate.set()
        self.arrival_gate = asyncio.Event()  # the network: a request reaches the server when set
        self.arrival_gate.set()
        self.entered = asyncio.Event()
        self.running: dict[str, asyncio.Future] = {}
        self.calls: list[dict[str, Any]] = []
        self.hold_rid = ""
        """The request with this rid runs until a pause or ``abort_all_requests`` ends it."""

    def reply(self, body: dict[str, Any], n: int, finish: dict[str, Any]) -> dict[str, Any]:
        last = body["input_ids"][-1]
        ids = [(last + 1 + i) % 100 for i in range(n)]
        return {"text": "x" * n, "output_ids": ids, "meta_info": {
            "id": body["rid"], "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": n, "output_token_logprobs": [[-0.5, t, None] for t in ids],
            "weight_version": self.label}}  # SGLang: the label it serves when it answers


async def _generate(request: web.Request) -> web.Response:
    f: FakeSGLang = request.app[FAKE]
    body = await request.json()
    f.calls.append(body)
    f.entered.set()
    await f.arrival_gate.wait()
    await f.resumed.wait()  # a paused server holds what arrives (SGLang's is_pause_cond)
    await f.loaded.wait()  # a load in progress holds new requests (the model-update lock)
    done = asyncio.get_running_loop().create_future()
    f.running[body["rid"]] = done
    if body["rid"] == f.hold_rid:
        reply = await done  # runs until a pause or abort_all ends it
    else:
        reply = f.reply(body, body["sampling_params"]["max_new_tokens"], {"type": "length"})
    f.running.pop(body["rid"], None)
    return web.json_response(reply)


def _abort_running(f: FakeSGLang, n: int) -> None:
    for rid, done in list(f.running.items()):
        body = next(c for c in f.calls if c.get("rid") == rid)
        done.set_result(f.reply(body, n, {"type": "abort", "message": "Abort in running batch"}))


async def _pause(request: web.Request) -> web.Response:
    f: FakeSGLang = request.app[FAKE]
    if (await request.json()).get("mode", "abort") == "abort":
        _abort_running(f, 2)  # what runs returns with its tokens so far; in_place keeps it running
    f.paused = True
    f.resumed.clear()
    return web.json_response({"success": True})


async def _continue(request: web.Request) -> web.Response:
    f: FakeSGLang = request.app[FAKE]
    f.paused = False
    f.resumed.set()
    return web.json_response({"success": True})


async def _load(request: web.Request) -> web.Response:
    f: FakeSGLang = request.app[FAKE]
    body = await request.json()
    if body.get("abort_all_requests"):
        _abort_running(f, 2)
    f.loaded.clear()
    await f.load_gate.wait()
    if f.adopts_labels:
        f.label = body["weight_version"]
    f.loaded.set()
    return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                              "num_paused_requests": 0})


async def _model_info(request: web.Request) -> web.Response:
    return web.json_response({"model_path": "m", "is_generation": True, "weight_version": request.app[FAKE].label})


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="")


def _app(fake: FakeSGLang) -> web.Application:
    app = web.Application()
    app[FAKE] = fake
    app.router.add_post("/generate", _generate)
    app.router.add_post("/pause_generation", _pause)
    app.router.add_post("/continue_generation", _continue)
    app.router.add_post("/update_weights_from_disk", _load)
    app.router.add_get("/get_model_info", _model_info)
    app.router.add_get("/health", _ok)
    return app


CFG = ClientConfig(control_timeout_s=10, health_interval_s=3600)


@pytest.mark.parametrize("adopts_labels", [True, False])
def test_a_request_in_flight_when_a_pause_lands(adopts_labels: bool) -> None:
    async def main() -> None:
        fake = FakeSGLang(adopts_labels)
        async with serving_app(_app(fake)) as addr, HttpRolloutClient([addr], config=CFG) as client:
            fake.arrival_gate.clear()
            task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": N}))
            await fake.entered.wait()  # sent with version 0 recorded, not yet at the server
            await client.pause("abort")
            fake.arrival_gate.set()  # it arrives now: held by the pause
            while fake.resumed.is_set() or not fake.calls:
                await asyncio.sleep(0.01)
            await client.update_weights_from_disk("/ckpt/v1", version=1)
            await client.continue_generation()
            r = await task
        # It ran under version 1's weights (it was held until the continue): before, [0] * N.
        # A stand-in that reports no label it was given has the answer made again after the
        # continue (which weights made the first one is unknown).
        assert r.output_versions == [1] * N, r.output_versions
        assert len(r.output_ids) == N and r.resends == (0 if adopts_labels else 1)

    asyncio.run(main())


@pytest.mark.parametrize("adopts_labels", [True, False])
def test_abort_all_requests_without_a_pause(adopts_labels: bool) -> None:
    async def main() -> None:
        fake = FakeSGLang(adopts_labels)
        async with serving_app(_app(fake)) as addr, HttpRolloutClient([addr], config=CFG) as client:
            await client.update_weights_from_disk("/ckpt/v1", version=1)
            r = await client.generate([1, 2], {"max_new_tokens": 2})  # its label "1" shows it keeps labels
            assert r.output_versions == [1, 1]
            fake.hold_rid = "held"
            task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": 8}, rid="held"))
            while not fake.running:
                await asyncio.sleep(0.01)
            fake.load_gate.clear()
            update = asyncio.create_task(client.update_weights_from_disk("/ckpt/v2", version=2,
                                                                         abort_all_requests=True))
            while not any(c["rid"] == "held-r1" for c in fake.calls):  # re-sent at once, held by the load
                await asyncio.sleep(0.01)
            fake.load_gate.set()
            await update
            r = await task
        assert len(r.output_ids) == 8
        if adopts_labels:  # two tokens made by version 1 before the abort, the rest after the load
            assert r.output_versions == [1, 1] + [2] * 6, r.output_versions
        else:  # which weights made the aborted two is unknown: they were made again, by version 2
            assert r.output_versions == [2] * 8, r.output_versions
        # before: [1] * 8 in both (the re-send ran under version 2, stamped with the record at its send)

    asyncio.run(main())


def test_a_pause_that_keeps_a_request_running_across_an_update() -> None:
    """Under an ``in_place`` pause a running request stays on the server across the update and
    finishes under the new weights: its tokens come from both, and a reply without per-token
    versions cannot say which. They are made again rather than stamped with either version."""

    async def main() -> None:
        fake = FakeSGLang(adopts_labels=True)
        async with serving_app(_app(fake)) as addr, HttpRolloutClient([addr], config=CFG) as client:
            await client.update_weights_from_disk("/ckpt/v1", version=1)
            assert (await client.generate([1, 2], {"max_new_tokens": 2})).output_versions == [1, 1]
            fake.hold_rid = "kept"
            task = asyncio.create_task(client.generate([5, 6, 7], {"max_new_tokens": N}, rid="kept"))
            while "kept" not in fake.running:
                await asyncio.sleep(0.01)
            await client.pause("in_place")
            assert "kept" in fake.running  # still there, its KV and tokens so far kept
            await client.update_weights_from_disk("/ckpt/v2", version=2)
            await client.continue_generation()
            body = next(c for c in fake.calls if c["rid"] == "kept")
            fake.running["kept"].set_result(fake.reply(body, N, {"type": "length"}))  # labelled "2"
            r = await task
        assert r.resends == 1 and r.output_versions == [2] * N, (r.resends, r.output_versions)

    asyncio.run(main())
