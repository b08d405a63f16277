"""The OpenAI-compatible endpoints: plain and streamed answers agree with each other and with
/generate, logprobs are the reference forward's, errors name the OpenAI field."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import numpy as np

from areal_jax.models import encode_chat, load_pretrained, load_tokenizer
from tests.inference.reference import reference_logprobs
from tests.rollout_bridge.bridge_helpers import running_server

TIMEOUT = aiohttp.ClientTimeout(total=60)


async def _events(resp: aiohttp.ClientResponse) -> list[dict]:
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", events[-3:]
    return [json.loads(e[6:]) for e in events[:-1]]


def test_completions_and_chat_plain_and_streamed(tiny_dir: Path) -> None:
    model = load_pretrained(tiny_dir)
    tok = load_tokenizer(tiny_dir)

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, _), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"http://{addr}"
            body = {"model": "any", "prompt": "12+7=", "max_tokens": 6, "temperature": 0.7, "seed": 3,
                    "logprobs": 0, "ignore_eos": True, "user": "ignored"}
            async with s.post(url + "/v1/completions", json=body) as r:
                plain = await r.json()
            assert plain["object"] == "text_completion" and plain["usage"]["completion_tokens"] == 6
            choice = plain["choices"][0]
            assert choice["finish_reason"] == "length" and len(choice["logprobs"]["token_logprobs"]) == 6
            prompt_ids = tok.encode("12+7=", add_special_tokens=False)
            async with s.post(url + "/generate", json={"input_ids": prompt_ids, "return_logprob": True,
                                                       "sampling_params": {"max_new_tokens": 6, "temperature": 0.7,
                                                                           "sampling_seed": 3, "ignore_eos": True}}
                              ) as r:
                native = await r.json()
            assert choice["text"] == native["text"]
            np.testing.assert_allclose(choice["logprobs"]["token_logprobs"],
                                       reference_logprobs(model, prompt_ids, native["output_ids"], 0.7), atol=1e-4)
            async with s.post(url + "/v1/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
                chunks = await _events(r)
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == choice["text"]
            assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["total_tokens"]
            streamed_lps = [lp for c in chunks if c["choices"] for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
            np.testing.assert_allclose(streamed_lps, choice["logprobs"]["token_logprobs"], atol=1e-6)

            messages = [{"role": "user", "content": "3*4="}]
            chat = {"model": "any", "messages": messages, "max_tokens": 5, "temperature": 0.5, "seed": 9,
                    "logprobs": True}
            async with s.post(url + "/v1/chat/completions", json=chat) as r:
                reply = await r.json()
            c = reply["choices"][0]
            assert reply["object"] == "chat.completion" and c["message"]["role"] == "assistant"
            ids = encode_chat(tok, messages)
            assert reply["usage"]["prompt_tokens"] == len(ids)
            assert len(c["logprobs"]["content"]) == reply["usage"]["completion_tokens"]
            async with s.post(url + "/v1/chat/completions", json={**chat, "stream": True}) as r:
                chunks = await _events(r)
            assert chunks[0]["object"] == "chat.completion.chunk"
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
            assert text == c["message"]["content"] and chunks[-1]["choices"][0]["finish_reason"] is not None
            lps = [e["logprob"] for ch in chunks if ch["choices"][0]["logprobs"]
                   for e in ch["choices"][0]["logprobs"]["content"]]
            np.testing.assert_allclose(lps, [e["logprob"] for e in c["logprobs"]["content"]], atol=1e-6)

            for path, bad, field in (("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
                                     ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
                                     ("/v1/completions", {"prompt": "x", "max_tokens": 500}, "max_tokens"),
                                     ("/v1/chat/completions", {"messages": []}, "messages")):
                async with s.post(url + path, json=bad) as r:
                    assert r.status == 400 and field in (await r.json())["error"]["message"], (path, bad)
            async with s.get(url + "/v1/models") as r:
                assert (await r.json())["data"][0]["max_model_len"] == 64

    asyncio.run(main())
