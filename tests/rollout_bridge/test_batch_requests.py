"""SGLang's batch form of /generate (``input_ids`` a list of lists) on the embedded server, and the
client's ``generate_many``, which asks for a group's answers in one request (real HTTP, 127.0.0.1)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from areal_jax.models import load_pretrained
from rollout_bridge.client import ClientConfig, HttpRolloutClient
from tests.inference.reference import reference_greedy
from tests.rollout_bridge.bridge_helpers import ServerThread, running_server

PROMPTS = [[5, 17, 3, 42], [9, 11, 60, 2, 33, 7], [14]]


def _cfg(**kw: Any) -> ClientConfig:
    return ClientConfig(generate_timeout_s=120, control_timeout_s=30, all_down_wait_s=5, **kw)


async def _post(s: aiohttp.ClientSession, addr: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(f"http://{addr}/generate", json=body) as r:
        return r.status, await r.json()


def test_batch_form_answers_in_input_order_and_refuses_what_it_cannot_serve(server: ServerThread,
                                                                            tiny_dir: Path) -> None:
    addr, engine = server.addr, server.engine
    model = load_pretrained(tiny_dir)
    eos = model.config.eos_token_ids
    budgets = [3, 7, 5]

    async def main() -> None:
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": PROMPTS, "rid": ["a", "b", "c"], "return_logprob": True,
                    "sampling_params": [{"max_new_tokens": n, "temperature": 0.0} for n in budgets]}
            status, replies = await _post(s, addr, body)
            assert status == 200 and isinstance(replies, list)
            assert [r["meta_info"]["id"] for r in replies] == ["a", "b", "c"]
            for p, n, r in zip(PROMPTS, budgets, replies, strict=True):
                assert r["output_ids"] == reference_greedy(model, p, n, eos)
                assert [e[1] for e in r["meta_info"]["output_token_logprobs"]] == r["output_ids"]
                assert r["meta_info"]["prompt_tokens"] == len(p)
            # one sampling_params for all, rids left to the server
            status, replies = await _post(s, addr, {"input_ids": PROMPTS, "sampling_params": {
                "max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
            assert status == 200 and [len(r["output_ids"]) for r in replies] == [4, 4, 4]
            assert len({r["meta_info"]["id"] for r in replies}) == 3

            refused = [
                ({**body, "rid": ["a", "b"]}, "rid: has 2 entries for a batch of 3"),
                ({**body, "rid": "a"}, "rid: a batch of 3 inputs needs a list of 3 rids"),
                ({**body, "sampling_params": [{"max_new_tokens": 2}] * 2}, "sampling_params: has 2 entries"),
                ({**body, "input_ids": [[5], [100000], [6]]}, "input_ids (batch input 1): token id 100000"),
                ({**body, "sampling_params": [{}, {"temprature": 1.0}, {}]},
                 "sampling_params.temprature (batch input 1): unknown parameter"),
                ({**body, "input_ids": [[5], [], [6]]}, "input_ids (batch input 1): empty prompt"),
                ({**body, "text": ["a", "b", "c"]}, "text: send either text or input_ids"),
            ]
            for bad, message in refused:
                status, reply = await _post(s, addr, bad)
                assert status == 400 and reply["error"]["message"].startswith(message), (bad, reply)
            # a repeated rid: the whole batch is refused and its other inputs do not stay behind
            slow = {"max_new_tokens": 60, "ignore_eos": True}
            status, reply = await _post(s, addr, {"input_ids": PROMPTS, "rid": ["x", "y", "x"],
                                                  "sampling_params": slow})
            assert status == 400 and "rid 'x'" in reply["error"]["message"]
            assert engine.num_running == 0 and engine.num_waiting == 0

    asyncio.run(main())


def test_generate_many_matches_generate_and_resumes_a_paused_group(tiny_dir: Path) -> None:
    """A group asked at once gives the answers ``generate`` gives one by one; paused mid-way
    (abort), only the unfinished answers are re-sent, and each keeps its tokens and versions."""

    async def main() -> None:
        async with running_server(tiny_dir, num_slots=8) as (addr, engine), \
                HttpRolloutClient([addr], config=_cfg()) as client:
            greedy = {"max_new_tokens": 10, "temperature": 0.0}
            many = await client.generate_many(PROMPTS, greedy, rids=["g0", "g1", "g2"])
            ones = [await client.generate(p, greedy) for p in PROMPTS]
            assert [r.rid for r in many] == ["g0", "g1", "g2"]
            assert [r.output_ids for r in many] == [r.output_ids for r in ones]
            assert [r.finish_reason for r in many] == [r.finish_reason for r in ones]
            with pytest.raises(ValueError, match="rids has 1 entries for 3 prompts"):
                await client.generate_many(PROMPTS, greedy, rids=["z"])

            # a group of four long answers, paused mid-way
            sent: list[Any] = []
            real = client.pool.request  # count what goes over the wire

            async def counting(server: Any, method: str, path: str, **kw: Any) -> Any:
                if path == "/generate":
                    sent.append(kw["json_body"])
                return await real(server, method, path, **kw)

            client.pool.request = counting  # type: ignore[method-assign]
            prompt = PROMPTS[1]
            long = {"max_new_tokens": 90, "temperature": 1.0, "ignore_eos": True}
            task = asyncio.create_task(client.generate_many([prompt] * 4, long, rids=["l0", "l1", "l2", "l3"]))
            live = engine._live  # noqa: SLF001 - pause once every answer has tokens, none all of them

            async def started() -> None:
                while any(r not in live or len(live[r].out_ids) < 5 for r in ("l0", "l1", "l2", "l3")):
                    await asyncio.sleep(0.002)

            await asyncio.wait_for(started(), 30)
            await client.pause("abort")
            await client.update_weight_version(1)
            await client.continue_generation()
            res = await task
            assert len(sent) >= 2 and sent[0]["rid"] == ["l0", "l1", "l2", "l3"]
            assert sent[1]["rid"] == ["l0-r1", "l1-r1", "l2-r1", "l3-r1"]
            for r, resend in zip(res, sent[1]["input_ids"], strict=True):
                assert len(r.output_ids) == 90 and r.finish_reason == {"type": "length", "length": 90}
                vs = np.array(r.output_versions)
                assert set(vs.tolist()) == {0, 1} and (np.diff(vs) >= 0).all()
                k = int((vs == 0).sum())
                assert resend == prompt + r.output_ids[:k]  # the re-send carried the tokens so far
            client.pool.request = real  # type: ignore[method-assign]

    asyncio.run(main())


def test_generate_many_off_sends_one_request_per_answer(server: ServerThread) -> None:
    addr = server.addr

    async def main() -> None:
        async with HttpRolloutClient([addr], config=_cfg(batch_requests=False)) as client:
            sent: list[Any] = []
            real = client.pool.request

            async def counting(server: Any, method: str, path: str, **kw: Any) -> Any:
                sent.append(kw.get("json_body"))
                return await real(server, method, path, **kw)

            client.pool.request = counting  # type: ignore[method-assign]
            res = await client.generate_many(PROMPTS, {"max_new_tokens": 3, "ignore_eos": True})
            assert [len(r.output_ids) for r in res] == [3, 3, 3]
            assert sorted(b["input_ids"] for b in sent) == sorted(PROMPTS)  # three single-form requests

    asyncio.run(main())
