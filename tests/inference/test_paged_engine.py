"""The paged engine against full-forward references, in a pool so small that answers are retracted
and resumed, a group's answers share their prompt's pages and long prompts prefill in chunks:
greedy tokens and logprobs equal the reference's, a weight swap mid-answer stamps and computes
each token under the weights that made it, and after hundreds of requests with aborts and pauses
of every mode the allocator holds no page."""

from __future__ import annotations

import asyncio
import random
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
    joined,
    prompts,
    reference_greedy,
    reference_logprobs,
    run,
)

# 24 pages of 4 tokens (96 tokens) for 8 running answers of up to 64: answers must be retracted.
PAGED_CFG = EngineConfig(num_slots=8, max_seq_len=64, max_prefill_batch=4, decode_steps=4, seed=0, kv_cache="paged",
                         page_size=4, max_total_tokens=96, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def paged(ckpt: Path) -> PagedEngine:
    engine = Engine(load_pretrained(ckpt), PAGED_CFG)
    assert isinstance(engine, PagedEngine) and engine.allocator.num_pages == 24
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def test_ragged_shared_retracted_and_chunked_answers_equal_the_reference(paged: PagedEngine, model: Decoder) -> None:
    """Prompt lengths on and beside page boundaries (3, 4, 5, 8, 9), longer than a prefill chunk
    (17, 33, 40: prefilled 16 tokens a call), and a group of four answers to one prompt: each
    answer is the full forward pass's greedy decoding with its logprobs, though the pool forces
    retractions (each retracted answer prefills its prompt and tokens again)."""
    before = dict(paged.stats)
    ps = prompts([3, 4, 5, 8, 9, 17, 33, 40], seed=11)
    group = prompts([13], seed=12)[0]
    reqs = [GenerateRequest(p, greedy(12)) for p in ps] + [GenerateRequest(group, greedy(12)) for _ in range(4)]
    outs = generate_all(paged, reqs)
    for r, out in zip(reqs, outs, strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, 12), r.input_ids
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 0),
                                   atol=1e-4)
        assert out.finish_reason == {"type": "length", "length": 12} and out.output_versions == [0] * 12
    assert paged.stats["retractions"] > before["retractions"]
    assert paged.stats["shared_prompt_tokens"] > before["shared_prompt_tokens"]  # the group's prompt pages
    assert_no_page_leaked(paged)


def test_sampled_answers_are_the_same_whether_or_not_they_were_retracted(paged: PagedEngine) -> None:
    """A seeded sampled answer draws token i from its own PRNG stream at step i, so an answer
    retracted and resumed (the pool is crowded by 7 others) samples what it samples alone."""
    p = prompts([6], seed=13)[0]
    sp = SamplingParams(max_new_tokens=24, temperature=0.8, seed=5, ignore_eos=True)
    (alone,) = generate_all(paged, [GenerateRequest(p, sp)])
    before = paged.stats["retractions"]
    crowd = [GenerateRequest(q, SamplingParams(max_new_tokens=24, ignore_eos=True)) for q in prompts([9] * 7, seed=14)]
    outs = generate_all(paged, [*crowd, GenerateRequest(p, sp)])
    assert paged.stats["retractions"] > before
    assert outs[-1].output_ids == alone.output_ids


def test_weight_swap_mid_answer_stamps_and_computes_each_token_under_its_weights(
        paged: PagedEngine, model: Decoder, ckpt: Path, ckpt_v1: Path) -> None:
    """pause(retract), swap to v1, resume: the tokens sampled before carry version 0 and the v0
    model's logprobs; those after carry 1 and the v1 model's logprobs over the whole sequence
    (the retracted answer's pages were freed and prefilled again under v1)."""
    model_v1 = load_pretrained(ckpt_v1)
    p = prompts([7], seed=15)[0]

    async def go() -> object:
        await paged.start()
        try:
            agen = paged.stream(GenerateRequest(p, greedy(20)))  # each output: the new tokens
            pieces = []
            while sum(len(o.output_ids) for o in pieces) < 5:
                pieces.append(await anext(agen))
            await paged.pause("retract")
            await paged.update_weights(model_dir=str(ckpt_v1), version=1)
            await paged.resume()
            pieces += [o async for o in agen]
            return joined(pieces)
        finally:
            await paged.update_weights(model_dir=str(ckpt), version=0)
            await paged.stop()

    out = run(go())
    k = out.output_versions.count(0)
    assert 5 <= k < 20 and out.output_versions == [0] * k + [1] * (20 - k)
    ids = out.output_ids
    assert ids[:k] == reference_greedy(model, p, k) and ids[k:] == reference_greedy(model_v1, p + ids[:k], 20 - k)
    np.testing.assert_allclose(out.output_logprobs[:k], reference_logprobs(model, p, ids[:k], 0), atol=1e-4)
    np.testing.assert_allclose(out.output_logprobs[k:], reference_logprobs(model_v1, p + ids[:k], ids[k:], 0),
                               atol=1e-4)
    assert paged.allocator.used_pages == 0


@pytest.mark.slow
def test_no_page_is_held_after_many_requests_aborts_and_pauses(paged: PagedEngine) -> None:
    """300 requests of random lengths, groups and limits; some aborted while they wait or run,
    the engine paused in every mode meanwhile: every request ends, with at most its limit of
    tokens, and the allocator holds no page."""
    rng = random.Random(0)

    async def go() -> list:
        await paged.start()
        try:
            tasks, rids = [], []
            for i in range(300):
                n = rng.choice([1, 2, 3, 5, 8, 13, 21, 40])
                p = prompts([n], seed=i)[0] if rng.random() < 0.7 else prompts([11], seed=1)[0]
                sp = SamplingParams(max_new_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.5)
                req = GenerateRequest(p, sp)
                tasks.append(asyncio.create_task(paged.generate(req)))
                rids.append(req.rid)
                if i % 7 == 3:
                    await asyncio.sleep(0)
                    await paged.abort(rng.choice(rids))
                if i % 50 == 25:
                    await asyncio.sleep(0.05)
                    await paged.pause(("retract", "in_place", "abort")[i // 50 % 3])
                    await paged.resume()
            return await asyncio.gather(*tasks)
        finally:
            await paged.stop()

    outs = run(go())
    assert all(o.finished for o in outs)
    assert any(o.finish_reason["type"] == "abort" for o in outs)
    assert any(o.finish_reason["type"] != "abort" for o in outs)
    assert paged.num_live == 0
    assert_no_page_leaked(paged)


def test_serve_flags_size_the_pool_and_server_info_reports_it(tmp_path: Path) -> None:
    """SGLang's flags reach the engine with SGLang's meaning: --max-total-tokens is the pool,
    --page-size its pages, --context-length one request's limit; without a token count the pool
    is never more than max-running-requests x context-length."""
    from areal_jax.models.tiny import make_tiny_checkpoint
    from rollout_bridge.serve import build, parser

    model_dir = make_tiny_checkpoint(tmp_path / "tiny", model_type="qwen2", size="tiny")
    base = ["--model-path", str(model_dir), "--kv-cache", "paged", "--max-running-requests", "256",
            "--context-length", "32768", "--allow-overwrite-longer-context-len", "--skip-server-warmup"]
    engine = build(parser().parse_args([*base, "--max-total-tokens", "16384", "--page-size", "16"]))[1]
    assert isinstance(engine, PagedEngine)
    assert (engine.allocator.num_pages, engine.allocator.page_size) == (1024, 16)
    info = engine.server_info()
    assert (info["max_total_num_tokens"], info["page_size"], info["max_running_requests"], info["context_length"],
            info["max_req_input_len"]) == (16384, 16, 256, 32768, 32767)
    small = build(parser().parse_args(["--model-path", str(model_dir), "--kv-cache", "paged", "--context-length", "64",
                                       "--max-running-requests", "4", "--skip-server-warmup"]))[1]
    assert small.allocator.max_total_tokens == 4 * 64  # the most 4 requests of 64 tokens can hold
    with pytest.raises(ValueError, match="max_total_tokens"):
        EngineConfig(kv_cache="paged", page_size=16, max_total_tokens=8)


def test_two_engines_on_one_model_step_with_their_own_attention_backend(model: Decoder) -> None:
    """The paged attention is a static argument of the compiled steps (``attention_backend``),
    not a property of the model: two engines on one model object each trace their steps with
    their own choice, the kernel (a ``pallas_call``) only in the one given ``fa``, and the model
    carries no choice of either. (This CPU refuses ``fa`` at start, no kernel runs here for real,
    so the second engine is given it after construction; Pallas traces the GPU decode kernel in
    interpret mode. Before, the choice was an attribute set on the model when an engine was built.)"""
    cfg = EngineConfig(num_slots=8, max_seq_len=64, decode_steps=2, seed=0, kv_cache="paged", page_size=16,
                       max_total_tokens=512, attention_backend="native")
    native, fa = Engine(model, cfg), Engine(model, cfg)
    fa.attention_backend = "fa"

    def traced(engine: PagedEngine) -> dict[str, str]:
        out = {}
        for shape in engine.step_shapes()[:1] + [engine._decode_shape(engine.min_decode_rows)]:  # noqa: SLF001
            fn, args, static = engine._warm_call(shape)  # noqa: SLF001
            assert static["attention_backend"] == engine.attention_backend
            out[shape[0]] = str(fn.trace(engine.state, engine._lanes[0].cache, *args, **static).jaxpr)  # noqa: SLF001
        return out

    plain, kernel = traced(native), traced(fa)
    assert not any("pallas_call" in j for j in plain.values())
    assert "pallas_call" in kernel["decode"] and "pallas_call" in kernel["mixed"]  # the mixed step's decode rows
    assert not hasattr(model, "paged_attention_backend") and native.attention_backend == "native"
