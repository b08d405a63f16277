"""Streaming costs grow with the answer, not its square: the engine's stream hands each reader the
tokens new since its last read (no queue of cumulative snapshots), and the server decodes a few
tokens per event (``IncrementalDetokenizer``), whose pieces join to the full decode, multi-byte
characters split over tokens included (real tokenizers, real HTTP on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from areal_jax.inference.types import GenerateRequest, SamplingParams
from areal_jax.models import load_tokenizer
from rollout_bridge.detokenize import IncrementalDetokenizer
from tests.rollout_bridge.bridge_helpers import ServerThread

TIMEOUT = aiohttp.ClientTimeout(total=120)
TEXT = "héllo wörld, 日本語の文 😀🎉 ok " * 32  # 1-, 2-, 3- and 4-byte characters


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Any:
    """One server for the module, its tokenizer counting what it decodes."""
    with ServerThread(tiny_dir, max_seq_len=128, tokenizer=CountingTokenizer(load_tokenizer(tiny_dir))) as srv:
        yield srv


class CountingTokenizer:
    """A real tokenizer that records how many tokens each ``decode`` call was given."""

    def __init__(self, tok: Any) -> None:
        self.tok, self.decoded = tok, []

    def decode(self, ids: Any, **kw: Any) -> str:
        self.decoded.append(len(ids))
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges over all 256 bytes: every UTF-8 byte is its own token, so a
    non-ASCII character is split over 2-4 tokens (the hard case for streamed text)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(["<|end|>"] + sorted(bytes_to_unicode().values()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|end|>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style pieces (a leading '▁' is a space, dropped at the start of a decode)."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁a": 3, "b": 4}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pieces_join_to_the_full_decode_with_split_characters(seed: int) -> None:
    tok = CountingTokenizer(byte_tokenizer())
    ids = tok.encode(TEXT, add_special_tokens=False) + [0]
    assert len(ids) > len(TEXT) + 100  # the multi-byte characters are split over tokens
    detok, rng, pieces, pos = IncrementalDetokenizer(tok), random.Random(seed), [], 0
    per_push = []
    while pos < len(ids):
        step = rng.choice([1, 1, 2, 3, 5])
        tok.decoded.clear()
        pieces.append(detok.push(ids[pos:pos + step], final=pos + step >= len(ids)))
        per_push.append(sum(tok.decoded))
        pos += step
    assert "".join(pieces) == tok.tok.decode(ids, skip_special_tokens=True) == TEXT
    assert all("\ufffd" not in p for p in pieces)  # half a character is never sent
    # Each push decodes the tokens since the emission before last (pushes that end inside a
    # character emit nothing and widen it a little), twice: a few dozen tokens at most, where a
    # decode of the answer so far reaches all of its 1,500.
    assert max(per_push) <= 64 < len(ids) // 20
    assert sum(per_push) <= 8 * len(ids)
    assert detok.text_len == len(TEXT)


def test_a_trailing_half_character_is_sent_at_the_end_as_the_full_decode_gives_it() -> None:
    tok = byte_tokenizer()
    ids = tok.encode("ok 😀", add_special_tokens=False)[:-2]  # the emoji's last two bytes never come
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([t]) for t in ids)
    assert text == "ok "
    text += detok.push([], final=True)
    assert text == tok.decode(ids) and text.endswith("\ufffd")


def test_leading_space_pieces_decode_in_context() -> None:
    tok = metaspace_tokenizer()
    ids = [1, 2, 3, 4, 2]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids]
    assert pieces == ["hello", " world", " a", "b", " world"]
    assert "".join(pieces) == tok.decode(ids)


def test_a_slow_reader_gets_the_steps_it_missed_in_one_output(server: ServerThread) -> None:
    """No queue of cumulative snapshots: the outputs a reader has not taken are one output of the
    new tokens, not one copy of the whole answer per step."""
    engine = server.engine

    async def main() -> None:
        req = GenerateRequest(input_ids=[3, 4, 5], rid="slow",
                              sampling=SamplingParams(max_new_tokens=80, temperature=0.0, ignore_eos=True))
        whole = await engine.generate(GenerateRequest(input_ids=[3, 4, 5], rid="whole", sampling=req.sampling))
        finished = engine.stats["finished_requests"]
        parts = engine.stream(req)
        first = await anext(parts)
        while engine.stats["finished_requests"] == finished:  # generated to its end, unread
            await asyncio.sleep(0.01)
        rest = [p async for p in parts]
        assert len(rest) == 1 and rest[0].finished  # everything since the first read, at once
        ids = first.output_ids + rest[0].output_ids
        assert ids == whole.output_ids and len(rest[0].output_ids) == len(rest[0].output_logprobs) \
            == len(rest[0].output_versions) > 0

    server.run(main())


def _events(raw: bytes) -> list[dict[str, Any]]:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("incremental", [True, False])
def test_streamed_events_decode_a_bounded_window_and_join_to_the_answer(server: ServerThread,
                                                                       incremental: bool) -> None:
    tok, addr = server.state.tokenizer, server.addr
    server.state.incremental_streaming_output = incremental
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 100, "temperature": 0, "ignore_eos": True}}

    async def main() -> None:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            async with s.post(f"http://{addr}/generate", json=body) as resp:
                whole = await resp.json()
            tok.decoded.clear()
            async with s.post(f"http://{addr}/generate", json={**body, "stream": True}) as resp:
                parts = _events(await resp.read())
            streamed = list(tok.decoded)
            async with s.post(f"http://{addr}/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 100, "temperature": 0, "ignore_eos": True}) as resp:
                plain = (await resp.json())["choices"][0]["text"]
            tok.decoded.clear()
            async with s.post(f"http://{addr}/v1/completions", json={
                    "prompt": [3, 4, 5], "max_tokens": 100, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as resp:
                chunks = _events(await resp.read())
            openai = list(tok.decoded)
        assert len(whole["output_ids"]) == 100
        if incremental:
            assert "".join(p["text"] for p in parts) == whole["text"]
            assert sum((p["output_ids"] for p in parts), []) == whole["output_ids"]
        else:  # every event is the answer so far, as stock SGLang sends it
            assert parts[-1]["text"] == whole["text"] and parts[-1]["output_ids"] == whole["output_ids"]
            assert all(whole["text"].startswith(p["text"]) for p in parts)
        assert "".join(c["choices"][0]["text"] for c in chunks) == plain == whole["text"]
        # Two decodes per event of the tokens since the emission before last (a decode call's
        # tokens, 1-8 per step on this engine), never the answer so far: the old code decoded
        # 1 + 2 + ... + 100 tokens over the stream.
        for decoded in (streamed, openai):
            assert len(decoded) >= 2 * 4 and max(decoded) <= 2 * 16, decoded
            assert sum(decoded) <= 4 * 100

    asyncio.run(main())
