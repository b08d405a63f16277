"""The embedded server's request handling: any weight_version label, duplicate rids, a bounded
queue (503 and the client's back-off), disconnects and client timeouts that abort, per-server
random seeds, /get_weight_version and /metrics (counts and tokens/s; real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from areal_jax.models import load_tokenizer
from rollout_bridge.client import ClientConfig, HttpRolloutClient, RolloutError
from tests.rollout_bridge.bridge_helpers import running_server

LONG = {"max_new_tokens": 24, "ignore_eos": True}
TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _until(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_labels_duplicate_rid_and_metrics(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"http://{addr}"
            async with s.get(url + "/get_weight_version") as r:
                assert (await r.json()) == {"weight_version": "default"}
            async with s.post(url + "/update_weight_version", json={"new_version": "step-3"}) as r:
                assert r.status == 200, await r.text()
            body = {"model_path": str(tiny_dir), "weight_version": "v1"}
            async with s.post(url + "/update_weights_from_disk", json=body) as r:
                assert r.status == 200 and (await r.json())["weight_version"] == "v1"
            async with s.get(url + "/get_weight_version") as r:
                assert (await r.json()) == {"weight_version": "v1"}
            gen = {"input_ids": [5, 6, 7], "sampling_params": LONG, "rid": "dup"}
            async with s.post(url + "/pause_generation", json={"mode": "in_place"}) as r:
                assert r.status == 200
            first = asyncio.create_task(s.post(url + "/generate", json=gen))
            await _until(lambda: engine.num_waiting == 1)
            async with s.post(url + "/generate", json=gen) as r:
                assert r.status == 400 and "rid" in (await r.json())["error"]["message"]
            t_before = time.monotonic()
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            t_after = time.monotonic()
            name = f'model_name="{tiny_dir}"'
            assert f"sglang:gen_throughput{{{name}}} 0.0" in text  # the first scrape has no interval
            assert f"sglang:num_queue_reqs{{{name}}} 1.0" in text
            assert f"sglang:num_running_reqs{{{name}}} 0.0" in text
            assert f'areal_jax:weight_version{{{name},weight_version="v1"}} 1.0' in text
            assert "# TYPE sglang:generation_tokens_total counter" in text
            assert f"areal_jax:prefill_seconds_total{{{name}}} 0.0" in text  # nothing has run yet
            assert f"areal_jax:decode_seconds_total{{{name}}} 0.0" in text
            assert f"areal_jax:mixed_seconds_total{{{name}}} 0.0" in text
            t_resume = time.monotonic()
            async with s.post(url + "/continue_generation", json={}) as r:
                assert r.status == 200
            async with await first as r:
                reply = await r.json()
            t_done = time.monotonic()
            assert reply["meta_info"]["weight_version"] == "v1" and len(reply["output_ids"]) == 24
            t_before_2 = time.monotonic()
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            t_after_2 = time.monotonic()
            assert f"sglang:generation_tokens_total{{{name}}} 24.0" in text
            # 24 tokens between the scrapes, over an interval the server measured inside ours
            rate = float(next(line.split()[-1] for line in text.splitlines()
                              if line.startswith("sglang:gen_throughput{")))
            assert 24 / (t_after_2 - t_before) <= rate <= 24 / (t_before_2 - t_after), rate
            # One request, so one lane at a time: its prefill and decode calls ran between resume and
            # reply (the paged engine prefills in a mixed call, which also decodes its first token).
            seconds = {k: float(next(line.split()[-1] for line in text.splitlines()
                                     if line.startswith(f"areal_jax:{k}_seconds_total{{")))
                       for k in ("prefill", "mixed", "decode")}
            assert seconds["prefill"] + seconds["mixed"] > 0 and seconds["decode"] > 0, seconds
            assert sum(seconds.values()) <= t_done - t_resume, seconds
            # a prompt sent again reads the whole pages its first answer wrote (meta_info.cached_tokens)
            page, prompt = engine.cfg.page_size, list(range(5, 45))
            cached = []
            for _ in range(2):
                body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0,
                                                                 "ignore_eos": True}}
                async with s.post(url + "/generate", json=body) as r:
                    cached.append((await r.json())["meta_info"]["cached_tokens"])
            assert cached == [0, (len(prompt) - 1) // page * page] and cached[1] > 0
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            # the finished answers' written pages stay in the prefix cache until /flush_cache
            gauge = lambda text: float(next(line.split()[-1] for line in text.splitlines()  # noqa: E731
                                            if line.startswith("areal_jax:prefix_cache_tokens{")))
            assert gauge(text) == ((3 + 24 - 1) // page + (40 + 4 - 1) // page) * page > 0
            async with s.post(url + "/flush_cache") as r:
                assert r.status == 200, await r.text()
            async with s.get(url + "/metrics") as r:
                assert gauge(await r.text()) == 0.0

    asyncio.run(main())


def test_full_queue_answers_503_and_the_client_backs_off(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, num_slots=2, max_seq_len=64, max_queued_requests=2) as (addr, engine), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"http://{addr}"
            await s.post(url + "/pause_generation", json={"mode": "in_place"})
            queued = [asyncio.create_task(s.post(url + "/generate", json={"input_ids": [5, i],
                                                                          "sampling_params": LONG}))
                      for i in range(2)]
            await _until(lambda: engine.num_waiting == 2)
            async with s.post(url + "/generate", json={"input_ids": [5, 9], "sampling_params": LONG}) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert "queue is full" in (await r.json())["error"]["message"]
            async with HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=10)) as client:
                task = asyncio.create_task(client.generate([5, 10], {"max_new_tokens": 4, "ignore_eos": True}))
                await asyncio.sleep(0.3)  # refused at least once by now
                await client.continue_generation()
                result = await task
            assert len(result.output_ids) == 4 and result.resends >= 1
            for t in queued:
                async with await t as r:
                    assert r.status == 200

    asyncio.run(main())


def test_disconnects_and_client_timeouts_abort_on_the_server(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=1024) as (addr, engine), \
                running_server(tiny_dir, max_seq_len=64) as (other, _):
            url = f"http://{addr}"
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                await s.post(url + "/pause_generation", json={"mode": "in_place"})
                # a plain request whose client goes away
                plain = asyncio.create_task(s.post(url + "/generate", json={"input_ids": [5, 6],
                                                                            "sampling_params": LONG}))
                await _until(lambda: engine.num_waiting == 1)
                plain.cancel()
                await _until(lambda: engine.num_waiting == 0)
                await s.post(url + "/continue_generation", json={})
                # a stream closed after its first event, while the server is paused mid-answer
                # long enough to be running at the pause: the paged engine decodes several tokens a call
                # and finished a 24-token answer before the pause landed
                longer = {"max_new_tokens": 1000, "ignore_eos": True}
                async with s.post(url + "/generate", json={"input_ids": [5, 6], "sampling_params": longer,
                                                           "stream": True}) as r:
                    await r.content.readline()
                    await s.post(url + "/pause_generation", json={"mode": "in_place"})
                    assert engine.num_running == 1
                    r.close()
                await _until(lambda: engine.num_running == 0)
                await s.post(url + "/continue_generation", json={})
                await s.post(url + "/pause_generation", json={"mode": "in_place"})
                async with s.post(f"http://{other}/generate", json={"input_ids": [7, 8],  # compile there first
                                                                     "sampling_params": {"max_new_tokens": 5}}) as r:
                    assert r.status == 200
            # a client that times out on a server leaves nothing queued there (the disconnect alone
            # does that here; the client's own /abort_request: test_failover.py)
            # the paused server holds the request until this timeout; the other server's five
            # tokens (compiled above) come well within it, even on a loaded machine
            cfg = ClientConfig(generate_timeout_s=5.0, control_timeout_s=10, health_interval_s=60)
            async with HttpRolloutClient([addr, other], config=cfg) as client:
                # ignore_eos: the random tiny model samples its end token now and then (an answer of 2)
                result = await client.generate([7, 8], {"max_new_tokens": 5, "ignore_eos": True})
                assert len(result.output_ids) == 5 and result.resends == 1
                assert engine.num_waiting == 0
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                await s.post(url + "/continue_generation", json={})

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_two_servers_with_default_flags_sample_differently(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (a, ea), \
                running_server(tiny_dir, max_seq_len=64) as (b, eb):
            assert ea.seed != eb.seed
            async with HttpRolloutClient([a], config=ClientConfig(control_timeout_s=10)) as ca, \
                    HttpRolloutClient([b], config=ClientConfig(control_timeout_s=10)) as cb:
                sp = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
                ra, rb = await asyncio.gather(ca.generate([3, 4, 5], sp), cb.generate([3, 4, 5], sp))
                assert ra.output_ids != rb.output_ids
                seeded = {**sp, "sampling_seed": 1234}
                ra, rb = await asyncio.gather(ca.generate([3, 4, 5], seeded), cb.generate([3, 4, 5], seeded))
                assert ra.output_ids == rb.output_ids and ra.output_logprobs == rb.output_logprobs

    asyncio.run(main())


def test_client_caps_its_connections_per_server(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine):
            cfg = ClientConfig(max_connections_per_server=2, control_timeout_s=10)
            async with HttpRolloutClient([addr], config=cfg) as client:
                # The server paused by another hand: this client, which sends nothing while it has
                # the servers paused itself, sends to it, and the server holds what it gets.
                await engine.pause("in_place")
                tasks = [asyncio.create_task(client.generate([5, i], {"max_new_tokens": 3, "ignore_eos": True}))
                         for i in range(5)]
                await _until(lambda: engine.num_waiting == 2)
                await asyncio.sleep(0.3)
                assert engine.num_waiting == 2  # the other three wait for a connection on the client
                await client.continue_generation()  # control calls are not queued behind them
                results = await asyncio.gather(*tasks)
            assert [len(r.output_ids) for r in results] == [3] * 5

    asyncio.run(main())


def test_engine_error_is_a_500_and_the_client_resends_a_few_times(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine):
            real, faults = engine.decode_fn, {"left": 1}

            def flaky(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - a device fault, injected
                if faults["left"]:
                    faults["left"] -= 1
                    raise RuntimeError("injected device fault")
                return real(*args, **kwargs)

            engine.decode_fn = flaky
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                body = {"input_ids": [3, 4, 5], "sampling_params": LONG}
                async with s.post(f"http://{addr}/generate", json=body) as r:
                    assert r.status == 500
                    assert "injected device fault" in (await r.json())["error"]["message"]
            cfg = ClientConfig(generate_timeout_s=60, error_backoff_s=0.01, max_error_resends=2)
            async with HttpRolloutClient([addr], config=cfg) as client:
                faults["left"] = 1
                r = await client.generate([3, 4, 5], LONG)
                assert len(r.output_ids) == LONG["max_new_tokens"] and r.resends == 1
                faults["left"] = 100
                with pytest.raises(RolloutError, match="injected device fault"):
                    await client.generate([3, 4, 5], LONG)
                assert faults["left"] == 100 - (cfg.max_error_resends + 1)  # bounded
                assert client.in_rotation() == [f"http://{addr}"]  # and the server is not marked down
                engine.decode_fn = real
                assert len((await client.generate([3, 4, 5], LONG)).output_ids) == LONG["max_new_tokens"]

    asyncio.run(main())


def test_resent_answer_keeps_all_text_and_streams_send_increments(tiny_dir: Path) -> None:
    tok = load_tokenizer(tiny_dir)

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=128, app_kw={"incremental_streaming_output": True}) \
                as (addr, engine), HttpRolloutClient([addr], config=ClientConfig(generate_timeout_s=60)) as client:
            task = asyncio.create_task(client.generate([3, 4, 5], {"max_new_tokens": 60, "ignore_eos": True}))
            await _until(lambda: engine.stats["decode_calls"] >= 2, timeout=120)
            await client.pause("abort")
            await client.continue_generation()
            r = await task
            assert r.resends >= 1 and len(r.output_ids) == 60
            assert r.text == tok.decode(r.output_ids, skip_special_tokens=True)  # all segments, not the last

            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                async with s.get(f"http://{addr}/get_server_info") as resp:
                    assert (await resp.json())["incremental_streaming_output"] is True
                body = {"input_ids": [3, 4, 5], "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}}
                async with s.post(f"http://{addr}/generate", json=body) as resp:
                    whole = await resp.json()
                async with s.post(f"http://{addr}/generate", json={**body, "stream": True}) as resp:
                    events = [e for e in (await resp.read()).decode().split("\n\n") if e]
            parts = [json.loads(e[6:]) for e in events[:-1]]
            assert len(parts) > 2 and all(len(p["output_ids"]) < 20 for p in parts)  # no event repeats it all
            assert sum((p["output_ids"] for p in parts), []) == whole["output_ids"]
            assert "".join(p["text"] for p in parts) == whole["text"]
            lps = [e for p in parts for e in p["meta_info"]["output_token_logprobs"]]
            assert [e[1] for e in lps] == whole["output_ids"]
            assert np.allclose([e[0] for e in lps], [e[0] for e in whole["meta_info"]["output_token_logprobs"]],
                               atol=1e-5)
            assert parts[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]

    asyncio.run(main())


def test_authorization_header_that_is_not_utf8_is_a_401(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, api_key="sekret", max_seq_len=64) as (addr, _):
            host, port = addr.split(":")
            for auth in (b"Bearer \xff\xfe", b"\xc3\x28", "Bearer sekrét".encode("latin-1")):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /get_model_info HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth
                             + b"\r\nConnection: close\r\n\r\n")
                await writer.drain()
                status = (await asyncio.wait_for(reader.read(), 30)).split(b"\r\n", 1)[0]
                writer.close()
                assert status.split()[1] == b"401", (auth, status)

    asyncio.run(main())


def test_shutdown_answers_requests_in_flight_with_their_tokens(tiny_dir: Path) -> None:
    from areal_jax.inference.engine import Engine, EngineConfig
    from areal_jax.models import load_pretrained
    from rollout_bridge.server import build_app, start_server

    async def main() -> None:
        model = load_pretrained(tiny_dir)
        engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=512, seed=0))
        runner, port = await start_server(build_app(engine, load_tokenizer(tiny_dir)), "127.0.0.1", 0,
                                          shutdown_timeout=30)
        url = f"http://127.0.0.1:{port}/generate"
        body = {"input_ids": [3, 4, 5], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async def plain() -> dict:
                async with s.post(url, json=body) as r:
                    assert r.status == 200
                    return await r.json()

            async def streamed() -> dict:
                async with s.post(url, json={**body, "stream": True}) as r:
                    events = [e for e in (await r.read()).decode().split("\n\n") if e]
                assert events[-1] == "data: [DONE]"
                return json.loads(events[-2][6:])

            tasks = [asyncio.create_task(plain()), asyncio.create_task(streamed())]
            await _until(lambda: engine.stats["decode_calls"] >= 4, timeout=120)
            await runner.cleanup()
            for reply in await asyncio.gather(*tasks):
                meta = reply["meta_info"]
                assert meta["finish_reason"] == {"type": "abort", "message": "server shutting down"}
                assert 0 < len(reply["output_ids"]) < 400  # partial, to resume elsewhere
                assert len(meta["output_token_logprobs"]) == len(reply["output_ids"])

    asyncio.run(main())


@pytest.mark.slow
def test_warmup_compiles_every_step_shape_before_health_says_ready(tiny_dir: Path) -> None:
    from areal_jax.inference.engine import Engine, EngineConfig
    from areal_jax.models import load_pretrained
    from rollout_bridge.server import build_app, start_server

    async def main() -> None:
        # the slot engine compiles every shape it can ask for at warm-up (the paged one compiles the
        # first requests' few and the rest on first use: test_paged_server.py)
        cfg = EngineConfig(num_slots=2, max_seq_len=64, chunked_prefill_size=16, max_prefill_batch=2, lanes=1, seed=0,
                           kv_cache="slots")
        engine = Engine(load_pretrained(tiny_dir), cfg)
        runner, port = await start_server(build_app(engine, warmup=True), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                async with s.get(url + "/health") as r:
                    assert r.status == 503 and "warming up" in (await r.json())["error"]["message"]
                async with s.post(url + "/generate", json={"input_ids": [3]}) as r:
                    assert r.status == 503
                while True:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                    await asyncio.sleep(0.1)
                async with s.get(url + "/get_server_info") as r:
                    state = (await r.json())["internal_states"][0]
                assert state["ready"] and state["warmup"]["shapes"] == len(engine.step_shapes())
                steps = (engine.prefill_fn, engine.prefill_chunk_fn, engine.share_fn, engine.decode_fn)
                compiled = [f._cache_size() for f in steps]
                assert sum(compiled) == len(engine.step_shapes()) and compiled[2] > 0
                # prompts of every kind (short, batched, chunked, near the context, sent twice at
                # once) compile nothing new
                # (prompt + max_new_tokens stays below the 64-token context, SGLang's rule)
                lengths = [1, 3, 3, 16, 17, 30, 33, 47, 49, 61, 62]
                bodies = [{"input_ids": [5] * n, "sampling_params": {"max_new_tokens": 63 - n, "ignore_eos": True}}
                          for n in lengths]

                async def one(body: dict) -> int:
                    async with s.post(url + "/generate", json=body) as r:
                        return len((await r.json())["output_ids"])

                assert await asyncio.gather(*map(one, bodies)) == [63 - n for n in lengths]
                assert [f._cache_size() for f in steps] == compiled
        finally:
            await runner.cleanup()

    asyncio.run(main())
