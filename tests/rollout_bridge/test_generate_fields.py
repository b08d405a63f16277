"""/generate's optional fields: prompt logprobs from ``logprob_start_len``, top logprobs
(``top_logprobs_num``) against a full forward pass, and SGLang fields this server does not
implement, which are refused unless left at their defaults."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import jax
import numpy as np

from areal_jax.models import load_pretrained, load_tokenizer
from tests.inference.reference import _logits
from tests.rollout_bridge.bridge_helpers import ServerThread

TIMEOUT = aiohttp.ClientTimeout(total=120)
PROMPT = [5, 17, 3, 42, 9, 11]


def test_prompt_and_top_logprobs_match_a_full_forward(server: ServerThread, tiny_dir: Path) -> None:
    addr = server.addr
    model, tok = load_pretrained(tiny_dir), load_tokenizer(tiny_dir)
    temperature, k = 0.7, 3

    async def main() -> dict:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
                    "return_text_in_logprobs": True, "return_prompt_token_ids": True,
                    "sampling_params": {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True}}
            async with s.post(f"http://{addr}/generate", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    reply = asyncio.run(main())
    meta, out = reply["meta_info"], reply["output_ids"]
    assert reply["prompt_token_ids"] == PROMPT
    logp = np.asarray(jax.nn.log_softmax(_logits(model, PROMPT + out) / temperature, axis=-1))
    # prompt: position p is predicted by row p - 1; position 0 has no logprob
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == PROMPT and inputs[0][0] is None
    np.testing.assert_allclose([e[0] for e in inputs[1:]], [logp[p - 1, PROMPT[p]] for p in range(1, len(PROMPT))],
                               atol=1e-4)
    assert [e[2] for e in inputs] == [tok.decode([t]) for t in PROMPT]
    assert meta["input_top_logprobs"][0] is None
    for p, row in enumerate(meta["input_top_logprobs"][1:], start=1):
        _check_top(row, logp[p - 1], k)
    # output: token i is predicted by row len(PROMPT) - 1 + i
    assert len(meta["output_top_logprobs"]) == len(out)
    for i, row in enumerate(meta["output_top_logprobs"]):
        _check_top(row, logp[len(PROMPT) - 1 + i], k)
        assert [e[2] for e in row] == [tok.decode([e[1]]) for e in row]
    np.testing.assert_allclose([e[0] for e in meta["output_token_logprobs"]],
                               [logp[len(PROMPT) - 1 + i, t] for i, t in enumerate(out)], atol=1e-4)

    # logprob_start_len later in the prompt: only the positions from there
    async def later() -> dict:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": 4,
                    "sampling_params": {"max_new_tokens": 2, "temperature": temperature}}
            async with s.post(f"http://{addr}/generate", json=body) as r:
                return (await r.json())["meta_info"]

    meta = asyncio.run(later())
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[4:]
    np.testing.assert_allclose([e[0] for e in meta["input_token_logprobs"]], [logp[3, PROMPT[4]], logp[4, PROMPT[5]]],
                               atol=1e-4)
    assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


def _check_top(row: list, logp_row: np.ndarray, k: int) -> None:
    want = np.argsort(-logp_row)[:k]
    assert [e[1] for e in row] == want.tolist()
    np.testing.assert_allclose([e[0] for e in row], logp_row[want], atol=1e-4)


def test_unimplemented_and_unknown_fields_are_refused(server: ServerThread, tiny_dir: Path) -> None:
    addr = server.addr
    async def main() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            url = f"http://{addr}/generate"
            base = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2}}
            # what AReaL sends: defaults of fields we do not implement
            ok = {**base, "image_data": [], "stream": False, "return_hidden_states": False, "lora_path": None,
                  "custom_labels": {}, "routed_experts_start_len": 0, "logprob_start_len": -1}
            async with s.post(url, json=ok) as r:
                assert r.status == 200, await r.text()
            for field, value in (("lora_path", "adapter"), ("image_data", ["img.png"]), ("priority", 0),
                                 ("return_hidden_states", True), ("session_params", {"id": "s"}),
                                 ("token_ids_logprob", [1, 2]), ("custom_labels", {"a": "b"})):
                async with s.post(url, json={**base, field: value}) as r:
                    message = (await r.json())["error"]["message"]
                    assert r.status == 400 and message.startswith(f"{field}: not supported"), (field, message)
            async with s.post(url, json={**base, "temprature": 0.5}) as r:
                assert r.status == 400 and "unknown parameter 'temprature'" in (await r.json())["error"]["message"]
            for field, value in (("top_logprobs_num", 2), ("logprob_start_len", 0)):
                async with s.post(url, json={**base, field: value}) as r:
                    assert r.status == 400 and "needs return_logprob" in (await r.json())["error"]["message"]
            async with s.post(url, json={**base, "return_logprob": True, "logprob_start_len": 3}) as r:
                assert r.status == 400 and "logprob_start_len" in (await r.json())["error"]["message"]

    asyncio.run(main())
