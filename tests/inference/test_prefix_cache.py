"""The paged engine's prefix cache (SGLang's radix cache) against full-forward references: an
agent's next turn reads the pages its previous turn left and computes the reference's tokens and
logprobs; new weights drop what the old ones computed; ``flush_cache`` empties it; a pool full of
cached pages still admits new requests; ``--disable-radix-cache`` keeps nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.paged import PagedEngine
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import (
    assert_no_page_leaked,
    generate_all,
    prompts,
    reference_greedy,
    reference_logprobs,
    run,
)

PAGE = 4
CFG = EngineConfig(num_slots=4, max_seq_len=96, max_prefill_batch=4, decode_steps=4, seed=0, kv_cache="paged",
                   page_size=PAGE, max_total_tokens=160, chunked_prefill_size=32)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def paged(ckpt: Path) -> PagedEngine:
    engine = Engine(load_pretrained(ckpt), CFG)
    assert isinstance(engine, PagedEngine) and engine.scheduler.cache is not None
    return engine


def _gained(engine: PagedEngine, before: dict, *keys: str) -> dict:
    return {k: engine.stats[k] - before[k] for k in keys}


def test_a_next_turn_reads_the_previous_turns_pages_and_equals_the_reference(paged: PagedEngine,
                                                                             model: Decoder) -> None:
    """Turn 1 (a 30-token prompt, 13 tokens of answer) finishes; turn 2 sends its prompt and answer
    and 6 tokens more: its first 40 tokens (the whole pages turn 1 wrote: all its tokens but
    the last) come from the cache, it prefills the other 8, and its tokens and logprobs are the
    full forward pass's."""
    p = prompts([30], seed=60)[0]
    (first,) = generate_all(paged, [GenerateRequest(p, greedy(13))])
    assert paged.scheduler.cached_pages == (30 + 13 - 1) // PAGE
    turn2 = p + first.output_ids + prompts([6], seed=61)[0]
    before = dict(paged.stats)
    (second,) = generate_all(paged, [GenerateRequest(turn2, greedy(8))])
    assert _gained(paged, before, "cached_prompt_tokens", "prefill_tokens") == {
        "cached_prompt_tokens": 40, "prefill_tokens": len(turn2) - 1 - 40}
    assert (first.cached_tokens, second.cached_tokens) == (0, 40)  # SGLang's meta_info.cached_tokens
    assert second.output_ids == reference_greedy(model, turn2, 8)
    np.testing.assert_allclose(second.output_logprobs, reference_logprobs(model, turn2, second.output_ids, 0),
                               atol=1e-4)
    assert_no_page_leaked(paged)


def test_new_weights_are_not_served_the_old_weights_pages(paged: PagedEngine, ckpt: Path, ckpt_v1: Path) -> None:
    """A prompt answered under v0 leaves its pages; after an update to v1 the same prompt again
    reads none of them (prefilled in full) and its logprobs are v1's; ``flush_cache`` then drops
    the v1 pages."""
    model_v1 = load_pretrained(ckpt_v1)
    p = prompts([33], seed=62)[0]
    generate_all(paged, [GenerateRequest(p, greedy(4))])
    assert paged.scheduler.cached_pages == 9
    try:
        run(paged.update_weights(model_dir=str(ckpt_v1), version=1))
        assert paged.scheduler.cached_pages == 0
        before = dict(paged.stats)
        (out,) = generate_all(paged, [GenerateRequest(p, greedy(6))])
    finally:
        run(paged.update_weights(model_dir=str(ckpt), version=0))
    assert _gained(paged, before, "cached_prompt_tokens", "prefill_tokens") == {
        "cached_prompt_tokens": 0, "prefill_tokens": 32}
    assert out.output_ids == reference_greedy(model_v1, p, 6)
    np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model_v1, p, out.output_ids, 0), atol=1e-4)
    generate_all(paged, [GenerateRequest(p, greedy(4))])
    assert paged.scheduler.cached_pages > 0
    assert run(paged.flush_cache()) and paged.scheduler.cached_pages == 0 and paged.allocator.used_pages == 0


def test_a_pool_full_of_cached_pages_admits_new_requests_by_evicting_them(paged: PagedEngine,
                                                                            model: Decoder) -> None:
    """Ten answers of 60 tokens through a pool of 40 pages fill it with cached pages many times
    over: each new request is admitted by evicting the least recently used, and every answer is
    the reference's."""
    reqs = [GenerateRequest(p, greedy(12)) for p in prompts([48] * 10, seed=63)]
    before = paged.scheduler.cache.stats["evicted_pages"]
    outs = []
    for r in reqs:  # one at a time: each finds the pool as the previous ones left it
        outs += generate_all(paged, [r])
    assert paged.scheduler.cache.stats["evicted_pages"] - before >= 10 * 14 - 40
    for r, out in zip(reqs, outs, strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, 12)
    assert_no_page_leaked(paged)


def test_disable_radix_cache_keeps_no_page(ckpt: Path) -> None:
    engine = Engine(load_pretrained(ckpt), EngineConfig(**{**vars(CFG), "share_prompts": False}))
    p = prompts([30], seed=60)[0]
    generate_all(engine, [GenerateRequest(p, greedy(4))])
    assert engine.scheduler.cache is None and engine.allocator.used_pages == 0
    assert engine.server_info()["disable_radix_cache"] is True
