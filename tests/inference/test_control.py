"""Engine control: pause modes, weight updates (good and bad), abort, cancel, flush, streaming."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from areal_jax.inference import Engine, GenerateRequest, SamplingParams
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import CheckpointError, iter_hf_tensors, load_pretrained
from tests.inference.reference import joined, prompts, reference_greedy, reference_logprobs, run

LONG = SamplingParams(max_new_tokens=40, ignore_eos=True)


async def started(engine: Engine) -> Engine:
    await engine.start()
    return engine


def test_stream_yields_new_tokens_and_ends_finished(engine: Engine, model: Decoder) -> None:
    """Each streamed output carries only the tokens new since the previous one (no cumulative
    copies); joined, they are the greedy answer, and only the last is finished."""
    prompt = prompts([5])[0]
    greedy = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)

    async def go() -> list:
        await started(engine)
        try:
            return [o async for o in engine.stream(GenerateRequest(prompt, greedy))]
        finally:
            await engine.stop()
    outs = run(go())
    assert len(outs) > 2 and outs[-1].finish_reason == {"type": "length", "length": 40}
    assert all(o.finish_reason is None and o.output_ids for o in outs[:-1])
    whole = joined(outs)
    assert whole.output_ids == reference_greedy(model, prompt, 40)
    assert len(whole.output_logprobs) == len(whole.output_versions) == 40


def test_pause_abort_returns_partial_outputs(engine: Engine) -> None:
    async def go() -> None:
        await started(engine)
        try:
            stream = engine.stream(GenerateRequest(prompts([5])[0], LONG))
            await anext(stream)  # the request is running
            waiting = [asyncio.create_task(engine.generate(GenerateRequest(p, LONG))) for p in prompts([3] * 9)]
            await asyncio.sleep(0)
            await engine.pause("abort")
            last = [o async for o in stream][-1]
            assert last.finish_reason["type"] == "abort" and 0 < len(last.output_ids) < 40
            assert len(last.output_logprobs) == len(last.output_versions) == len(last.output_ids)
            for out in await asyncio.gather(*waiting):
                assert out.finish_reason["type"] == "abort" and len(out.output_ids) < 40
            assert engine.num_running == engine.num_waiting == 0
            await engine.resume()
            out = await engine.generate(GenerateRequest([7, 8], SamplingParams(max_new_tokens=3)))
            assert len(out.output_ids) == 3
        finally:
            await engine.stop()
    run(go())


def test_retract_update_resume_recomputes_under_new_weights(engine: Engine, model: Decoder, ckpt: Path,
                                                             ckpt_v1: Path) -> None:
    new_model = load_pretrained(ckpt_v1)
    tensors = dict(iter_hf_tensors(new_model))
    prompt = prompts([6], seed=7)[0]
    sp = SamplingParams(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=11, ignore_eos=True)

    async def go() -> list:
        await started(engine)
        try:
            stream = engine.stream(GenerateRequest(prompt, sp))
            first = [await anext(stream), await anext(stream)]
            await engine.pause("retract")
            assert engine.num_running == 0 and engine.num_waiting == 1
            await engine.update_weights(tensors, version=1)
            assert engine.version == 1
            await engine.resume()
            return first + [o async for o in stream]
        finally:
            await engine.update_weights(model_dir=str(ckpt), version=0)
            await engine.stop()
    out = joined(run(go()))
    assert out.finish_reason == {"type": "length", "length": 30} and out.weight_version == 1
    n_old = out.output_versions.count(0)
    assert 0 < n_old < 30 and out.output_versions == [0] * n_old + [1] * (30 - n_old)
    ids = out.output_ids
    np.testing.assert_allclose(out.output_logprobs[:n_old], reference_logprobs(model, prompt, ids, 0.7)[:n_old],
                               atol=1e-4)
    np.testing.assert_allclose(out.output_logprobs[n_old:], reference_logprobs(new_model, prompt, ids, 0.7)[n_old:],
                               atol=1e-4)


def test_update_from_dir_and_failed_updates_keep_old_weights(engine: Engine, model: Decoder, ckpt: Path,
                                                              ckpt_v1: Path) -> None:
    prompt = prompts([8], seed=8)[0]
    greedy = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    good = dict(iter_hf_tensors(model))
    bad_name = {"model.layers.0.self_attn.qkv_proj.weight": good["model.layers.0.self_attn.q_proj.weight"]}
    bad_shape = dict(good, **{"model.norm.weight": np.ones(3, np.float32)})

    async def go() -> None:
        await started(engine)
        try:
            for bad in (bad_name, bad_shape):
                with pytest.raises(CheckpointError):
                    await engine.update_weights(bad, version=5)
            with pytest.raises(CheckpointError):
                await engine.update_weights(model_dir=str(ckpt_v1 / "missing"), version=5)
            assert engine.version == 0
            out = await engine.generate(GenerateRequest(prompt, greedy))
            assert out.output_ids == reference_greedy(model, prompt, 8)
            await engine.update_weights(model_dir=str(ckpt_v1), version=2)
            out = await engine.generate(GenerateRequest(prompt, greedy))
            assert out.output_ids == reference_greedy(load_pretrained(ckpt_v1), prompt, 8)
            assert out.output_versions == [2] * 8 and out.weight_version == 2
        finally:
            await engine.update_weights(model_dir=str(ckpt), version=0)
            await engine.stop()
    run(go())


def test_pause_in_place_keeps_slots(engine: Engine) -> None:
    async def go() -> None:
        await started(engine)
        try:
            stream = engine.stream(GenerateRequest(prompts([4])[0], LONG))
            await anext(stream)
            await engine.pause("in_place")
            calls = engine.stats["decode_calls"]
            await asyncio.sleep(0.1)
            assert engine.stats["decode_calls"] == calls and engine.num_running == 1
            assert not await engine.flush_cache()  # refused: a request holds KV
            await engine.resume()
            last = [o async for o in stream][-1]
            assert last.finish_reason == {"type": "length", "length": 40}
            assert await engine.flush_cache()
        finally:
            await engine.stop()
    run(go())


def test_abort_by_rid_all_and_cancel(engine: Engine) -> None:
    async def go() -> None:
        await started(engine)
        try:
            reqs = [GenerateRequest(p, LONG) for p in prompts([3, 4, 5, 6])]
            stream = engine.stream(reqs[0])
            await anext(stream)
            tasks = [asyncio.create_task(engine.generate(r)) for r in reqs[1:]]
            await asyncio.sleep(0)
            assert await engine.abort(reqs[0].rid) == 1
            assert [o async for o in stream][-1].finish_reason["type"] == "abort"
            tasks[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await tasks[0]
            assert await engine.abort(abort_all=True) == 2
            for t in tasks[1:]:
                assert (await t).finish_reason["type"] == "abort"
            assert engine.num_running == engine.num_waiting == 0
            assert await engine.abort("no-such-rid") == 0
        finally:
            await engine.stop()
    run(go())
