"""Requests admitted together with the same tokens share one prefill (``share_prompts``): they
sample exactly what they sample when each is prefilled on its own, their logprobs match a full
forward pass, the answers of one group still differ, and the prefill really ran once per prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import generate_all, prompts, reference_logprobs

# The slot engine's share step (the paged engine shares whole prompt pages: test_paged_engine).
CFG = EngineConfig(num_slots=8, max_seq_len=64, max_prefill_batch=4, decode_steps=4, lanes=1, seed=0,
                   kv_cache="slots")


def _requests() -> tuple[list[list[int]], list[GenerateRequest]]:
    """Two groups of four answers to one prompt (engine-drawn and explicit seeds, top-p, a budget
    of one token), then a lone greedy prompt that waits for a free slot."""
    ps = prompts([9, 13, 5], seed=11)  # one padded length (16): one prefill call takes both groups
    free = SamplingParams(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    seeded = lambda i: SamplingParams(max_new_tokens=1 if i == 3 else 10, seed=i, top_p=0.9, ignore_eos=True)
    reqs = [GenerateRequest(ps[0], free) for _ in range(4)]
    reqs += [GenerateRequest(ps[1], seeded(i)) for i in range(4)]
    reqs.append(GenerateRequest(ps[2], SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)))
    return ps, reqs


def test_requests_with_one_prompt_prefill_once_and_sample_as_if_each_had_its_own(ckpt: Path, model: Decoder) -> None:
    shared = Engine(load_pretrained(ckpt), CFG)
    alone = Engine(load_pretrained(ckpt), EngineConfig(**{**vars(CFG), "share_prompts": False}))
    ps, reqs = _requests()
    ours, theirs = generate_all(shared, reqs), generate_all(alone, _requests()[1])

    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
        assert a.finish_reason == b.finish_reason
    for req, out in zip(reqs, ours, strict=True):
        assert len(out.output_ids) == req.sampling.max_new_tokens
        np.testing.assert_allclose(out.output_logprobs,
                                   reference_logprobs(model, req.input_ids, out.output_ids, req.sampling.temperature),
                                   atol=1e-4)
    # Each answer keeps its own random stream: sharing the prefill does not clone the samples.
    assert len({tuple(o.output_ids) for o in ours[:4]}) > 1
    assert len({tuple(o.output_ids) for o in ours[4:7]}) > 1

    # The first prefill took all eight slots, two prompts' rows; the other six requests copied them.
    assert shared.stats["shared_prompt_tokens"] == 3 * len(ps[0]) + 3 * len(ps[1])
    assert alone.stats["shared_prompt_tokens"] == 0
    assert shared.stats["prompt_tokens"] == alone.stats["prompt_tokens"] == sum(len(r.input_ids) for r in reqs)
    assert shared.stats["prefill_calls"] < alone.stats["prefill_calls"]


def test_warmup_compiles_the_share_step_for_every_row_count(ckpt: Path) -> None:
    engine = Engine(load_pretrained(ckpt), EngineConfig(**{**vars(CFG), "num_slots": 6}))
    assert engine.share_rows == (1, 2, 4, 6)
    shapes = engine.step_shapes()
    assert [s for s in shapes if s[0] == "share"] == [("share", r, 0, 0) for r in (1, 2, 4, 6)]
    off = Engine(load_pretrained(ckpt), EngineConfig(**{**vars(CFG), "share_prompts": False}))
    assert not [s for s in off.step_shapes() if s[0] == "share"]
    assert engine.warmup() == len(shapes)
    ps, reqs = _requests()
    before = engine.share_fn._cache_size()
    generate_all(engine, reqs)
    assert engine.share_fn._cache_size() == before  # every call hit a shape the warmup compiled
