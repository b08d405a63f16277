"""Packed prefill on the paged engine: the tokens of many requests prefill in one call, in blocks
of ``PREFILL_BLOCK`` tokens that each read their own pages, with a group's answers and answers
sent again after an abort (prompt plus their tokens so far) reading the pages of their common
prefix that another request writes in the same call. Tokens and logprobs equal a full forward
pass, the pool is empty after, and a group's prompt is prefilled once, in one call that also
samples every answer's first token. A call's blocks pad to one of a few counts (8, 32, 64
here), so the calls' shapes are the warm-up's whatever the requests' lengths."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.paged import PagedEngine
from areal_jax.inference.paged_batches import LONG_BLOCK, PREFILL_BLOCK
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import assert_no_page_leaked, prompts, reference_greedy, reference_logprobs, run

# Pages of 4 tokens in a pool that holds every request at once (no retraction: one call packs them all).
CFG = EngineConfig(num_slots=32, max_seq_len=1024, decode_steps=4, seed=0, kv_cache="paged", page_size=4,
                   max_total_tokens=2048, chunked_prefill_size=1024)


@pytest.fixture(scope="module")
def paged(ckpt: Path) -> PagedEngine:
    engine = Engine(load_pretrained(ckpt), CFG)
    assert isinstance(engine, PagedEngine)
    return engine


def _all_at_once(engine: PagedEngine, reqs: list[GenerateRequest], calls: list) -> list:
    """Queue ``reqs`` while the engine is paused, so its first round sees them all; record the
    requests' rows ``(seq, start, take)`` of every call that prefills."""
    build = engine._prefill_rows  # noqa: SLF001

    def recorded(seqs: list) -> tuple:
        rows, arrays = build(seqs)
        calls.append([(seq.req.rid, start, take) for seq, start, take in rows])
        return rows, arrays

    async def go() -> list:
        await engine.start()
        engine._prefill_rows = recorded  # noqa: SLF001
        try:
            await engine.pause("retract")
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs]
            while engine.num_waiting < len(reqs):
                await asyncio.sleep(0)
            await engine.resume()
            return await asyncio.gather(*tasks)
        finally:
            del engine._prefill_rows  # noqa: SLF001
            await engine.stop()

    return run(go())


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_packed_ragged_prefill_with_shared_prefixes_equals_the_full_forward(paged: PagedEngine,
                                                                            model: Decoder) -> None:
    """Prompts on and beside page boundaries (3 .. 33 tokens: one to three blocks), a group of
    four answers to one prompt, and three answers sent again with their own tokens after a
    common 10-token prompt: one call prefills every one of them, each in its own blocks, the
    readers of a shared prefix behind its writer; every greedy token and logprob equals the full
    forward pass's, and the pool holds no page after."""
    before = dict(paged.stats)
    ragged = prompts([3, 4, 5, 7, 8, 9, 15, 16, 17, 33], seed=41)
    group = prompts([13], seed=42)[0]
    common = prompts([10], seed=43)[0]
    resent = [common + tail for tail in prompts([2, 5, 7], seed=44)]
    reqs = ([GenerateRequest(p, greedy(6)) for p in ragged] + [GenerateRequest(group, greedy(6)) for _ in range(4)]
            + [GenerateRequest(p, greedy(6)) for p in resent])
    calls: list = []
    outs = _all_at_once(paged, reqs, calls)
    for r, out in zip(reqs, outs, strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, 6), r.input_ids
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 0),
                                   atol=1e-4)
    # One call prefilled all: every request but the group's followers (their 12-token prefix is
    # three whole pages of the leader's, and the 13th token their first decode step computes).
    first = calls[0]
    assert len(calls) == 1 and len(first) == len(reqs) - 3, calls
    assert {rid: (start, take) for rid, start, take in first}[reqs[0].rid] == (0, 2)
    # packed: each request pads to its own blocks (15 here), the call to the next of the block
    # counts (32), not every row to the widest request's 32 tokens
    blocks = sum(-(-take // PREFILL_BLOCK) for _, _, take in first)
    assert blocks == 15 and paged.block_counts(PREFILL_BLOCK) == [8, 32, 64]
    assert paged.stats["prefill_padded_tokens"] - before["prefill_padded_tokens"] == 32 * PREFILL_BLOCK
    # the resent answers read the common prompt's two whole pages (8 tokens) from the first of them
    readers = {rid: start for rid, start, _ in first}
    assert [readers[r.rid] for r in reqs[-3:]] == [0, 8, 8]
    assert paged.stats["shared_prompt_tokens"] - before["shared_prompt_tokens"] == 3 * 12 + 2 * 8
    assert_no_page_leaked(paged)


@pytest.mark.parametrize("length", [21, 23])
def test_a_group_prefills_its_prompt_once_in_the_call_that_samples_every_first_token(
        paged: PagedEngine, length: int) -> None:
    """Eight sampled answers to one prompt of 21 tokens (the whole pages of 20 shared: the
    followers compute nothing before their first decode step) or 23 (2 tokens of their own past
    the shared pages): one device call prefills the prompt once, and, four tokens being one
    call's decode steps, computes every answer's four tokens; the answers differ."""
    p = prompts([length], seed=45)[0]
    sp = SamplingParams(max_new_tokens=CFG.decode_steps, temperature=1.0, ignore_eos=True)
    reqs = [GenerateRequest(p, sp) for _ in range(8)]
    before = dict(paged.stats)
    calls: list = []
    outs = _all_at_once(paged, reqs, calls)
    gained = {k: paged.stats[k] - before[k] for k in ("mixed_calls", "decode_calls", "prefill_calls",
                                                      "prefill_tokens", "shared_prompt_tokens")}
    own = (length - 1) % CFG.page_size
    assert gained == {"mixed_calls": 1, "decode_calls": 0, "prefill_calls": 0,
                      "prefill_tokens": length - 1 + 7 * own, "shared_prompt_tokens": 7 * (length - 1 - own)}, gained
    assert calls[0][0] == (reqs[0].rid, 0, length - 1)
    assert all(len(o.output_ids) == CFG.decode_steps for o in outs)
    assert len({tuple(o.output_ids) for o in outs}) > 1
    assert_no_page_leaked(paged)


def test_a_long_chunk_prefills_in_wide_blocks_beside_short_prompts(paged: PagedEngine, model: Decoder) -> None:
    """A 700-token prompt at the head of the queue: its call packs blocks of ``LONG_BLOCK``
    tokens (eight, a call's budget of 1,024 tokens), the prompt in six, two short prompts in one
    each, and the third short prompt, for which no block is left, prefills in the next call;
    every answer equals the full forward pass's (the second call's three blocks pad to eight)."""
    ps = prompts([700, 5, 17, 40], seed=46)
    reqs = [GenerateRequest(p, greedy(4)) for p in ps]
    before = paged.stats["prefill_padded_tokens"]
    calls: list = []
    outs = _all_at_once(paged, reqs, calls)
    for r, out in zip(reqs, outs, strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, 4)
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 0),
                                   atol=1e-4)
    assert calls[0] == [(reqs[0].rid, 0, 699), (reqs[1].rid, 0, 4), (reqs[2].rid, 0, 16)]
    assert calls[1] == [(reqs[3].rid, 0, 39)]
    assert paged.stats["prefill_padded_tokens"] - before == 8 * LONG_BLOCK + 8 * PREFILL_BLOCK
    assert_no_page_leaked(paged)


def test_followers_left_for_a_later_call_read_the_pages_of_a_leader_that_finished(
        paged: PagedEngine, model: Decoder) -> None:
    """Four groups of eight answers to 250-token prompts (a leader's 249 tokens take 16 blocks,
    a follower's own token one): the first call's 64 blocks hold three groups but five followers
    of the third, whose leader's four tokens end it in that call; those five prefill their one
    token in the next call, on the 248 tokens of whole pages their finished leader wrote (no
    retraction, no second prefill of a prompt), with the full forward's logprobs."""
    ps = prompts([250] * 4, seed=47)
    sp = SamplingParams(max_new_tokens=CFG.decode_steps, temperature=1.0, ignore_eos=True)
    reqs = [GenerateRequest(p, sp) for p in ps for _ in range(8)]
    before = dict(paged.stats)
    calls: list = []
    outs = _all_at_once(paged, reqs, calls)
    assert [len(c) for c in calls] == [1 + 7 + 1 + 7 + 1 + 2, 5 + 1 + 7]
    assert paged.stats["prefill_tokens"] - before["prefill_tokens"] == 4 * 249 + 28
    assert paged.stats["retractions"] == before["retractions"]
    assert paged.stats["mixed_calls"] - before["mixed_calls"] == 2
    for r, out in zip(reqs, outs, strict=True):
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 1.0),
                                   atol=1e-4)
    assert_no_page_leaked(paged)
