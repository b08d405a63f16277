"""The engine against plain full-forward references: greedy tokens, logprobs, stops, limits,
seeds, many concurrent requests, and the bound on compiled shapes."""

from __future__ import annotations

import numpy as np
import pytest

from areal_jax.inference import Engine, GenerateRequest, SamplingParams
from areal_jax.models.decoder import Decoder
from tests.inference.reference import generate_all, prompts, reference_greedy, reference_logprobs, run


def test_greedy_vs_reference(engine: Engine, model: Decoder) -> None:
    ps = prompts([3, 9, 17, 30, 5, 12])  # more prompts than slots, several prefill buckets
    outs = generate_all(engine, [GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=0,
                                                                   ignore_eos=True)) for p in ps])
    for p, out in zip(ps, outs, strict=True):
        assert out.output_ids == reference_greedy(model, p, 12)
        assert out.finish_reason == {"type": "length", "length": 12}
        assert out.prompt_tokens == len(p) and out.output_versions == [0] * 12
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, p, out.output_ids, 0), atol=1e-4)
    assert len({tuple(o.output_ids) for o in outs}) > 1


def test_sampled_logprobs_vs_reference(engine: Engine, model: Decoder) -> None:
    ps = prompts([4, 11, 20], seed=1)
    sp = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, ignore_eos=True)
    outs = generate_all(engine, [GenerateRequest(p, sp) for p in ps])
    for p, out in zip(ps, outs, strict=True):
        assert len(out.output_ids) == 16
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, p, out.output_ids, 0.7), atol=1e-4)


def test_top_k_one_is_greedy(engine: Engine, model: Decoder) -> None:
    p = prompts([7], seed=2)[0]
    (out,) = generate_all(engine, [GenerateRequest(p, SamplingParams(max_new_tokens=10, top_k=1, ignore_eos=True))])
    assert out.output_ids == reference_greedy(model, p, 10)


def test_seeded_requests_reproduce(engine: Engine) -> None:
    p = prompts([6], seed=3)[0]
    req = lambda seed: GenerateRequest(p, SamplingParams(max_new_tokens=20, seed=seed, ignore_eos=True))
    first = generate_all(engine, [req(1), req(2)])
    # Same seeds again, now batched beside other traffic.
    again = generate_all(engine, [req(2), GenerateRequest(prompts([9])[0]), req(1)])
    assert first[0].output_ids == again[2].output_ids
    assert first[1].output_ids == again[0].output_ids
    assert first[0].output_ids != first[1].output_ids


def test_stop_tokens_eos_and_context_limit(engine: Engine, model: Decoder) -> None:
    p = prompts([5], seed=4)[0]
    greedy = reference_greedy(model, p, 12)
    stop = greedy[6]
    cut = greedy.index(stop) + 1
    outs = generate_all(engine, [
        GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop])),
        GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=[stop], ignore_eos=True)),
        GenerateRequest(prompts([60])[0], SamplingParams(max_new_tokens=100, ignore_eos=True)),
        GenerateRequest(p, SamplingParams(max_new_tokens=0)),
    ])
    assert outs[0].output_ids == greedy[:cut] and outs[0].finish_reason == {"type": "stop", "matched": stop}
    assert outs[1].output_ids == greedy[:cut]
    assert outs[2].finish_reason == {"type": "length", "length": 4}  # 60 + 4 = max_seq_len
    assert outs[3].output_ids == [] and outs[3].output_logprobs == []

    eos, engine.eos_token_ids = engine.eos_token_ids, {greedy[3]}
    try:
        (out,) = generate_all(engine, [GenerateRequest(p, SamplingParams(max_new_tokens=12, temperature=0))])
    finally:
        engine.eos_token_ids = eos
    assert out.finish_reason == {"type": "stop", "matched": greedy[3]}
    assert out.output_ids == greedy[:greedy.index(greedy[3]) + 1]


def test_prompt_too_long_or_bad_params(engine: Engine) -> None:
    async def go() -> None:
        await engine.start()
        try:
            with pytest.raises(ValueError, match="64 tokens.*max_seq_len=64"):
                await engine.generate(GenerateRequest(list(range(64))))
            with pytest.raises(ValueError, match="top_p"):
                await engine.generate(GenerateRequest([1, 2], SamplingParams(top_p=0)))
            with pytest.raises(ValueError, match="vocabulary"):
                await engine.generate(GenerateRequest([1, 500]))
        finally:
            await engine.stop()
    run(go())


def test_many_requests_few_slots_bounded_compiles(engine: Engine) -> None:
    cfg = engine.cfg
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 60, 64).tolist()
    reqs = [GenerateRequest(p, SamplingParams(max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                                              temperature=float(rng.choice([0, 0.8, 1.0]))))
            for p in prompts(lengths, seed=6)]
    outs = generate_all(engine, reqs)
    assert [o.rid for o in outs] == [r.rid for r in reqs]
    for r, o in zip(reqs, outs, strict=True):
        want = min(r.sampling.max_new_tokens, cfg.max_seq_len - len(r.input_ids))
        assert o.finish_reason == {"type": "length", "length": want} and len(o.output_ids) == want
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.prefill_fn._cache_size() <= len(cfg.prefill_buckets) * len(cfg.prefill_rows)
    assert engine.decode_fn._cache_size() <= len(cfg.kv_buckets)
