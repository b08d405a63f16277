"""A lane that cannot recover: a step fails and so does the re-allocation of its cache (an OOM
after an OOM). The engine is then dead: it says so, fails every request at once, and stops
cleanly. Faults are injected by replacing the engine's step and cache allocation on one engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.types import EngineDeadError
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import prompts, run

SP = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _oom(*args: object, **kwargs: object) -> None:
    raise MemoryError("RESOURCE_EXHAUSTED: injected")


def test_a_lane_that_cannot_reallocate_kills_the_engine_loudly(ckpt: Path) -> None:
    engine = Engine(load_pretrained(ckpt), EngineConfig(num_slots=2, max_seq_len=64, lanes=1, seed=0))

    async def go() -> None:
        await engine.start()
        assert engine.alive and engine.error is None
        engine._run_step = _oom  # the step fails ...
        engine._fresh_cache = _oom  # ... and so does the cache it is given instead
        first = await asyncio.wait_for(engine.generate(GenerateRequest(prompts([4])[0], SP)), 60)
        assert first.finish_reason["status_code"] == 500, first.finish_reason
        await asyncio.wait_for(engine.wait_dead(), 60)
        assert not engine.alive
        assert isinstance(engine.error, MemoryError)
        # a dead engine refuses at once rather than queueing work no lane will take
        with pytest.raises(EngineDeadError, match="RESOURCE_EXHAUSTED"):
            await engine.generate(GenerateRequest(prompts([5])[0], SP))
        await engine.stop()  # does not re-raise the lane's error

    run(go())


def test_requests_waiting_when_the_engine_dies_fail_at_once(ckpt: Path) -> None:
    engine = Engine(load_pretrained(ckpt), EngineConfig(num_slots=1, max_seq_len=64, lanes=1, seed=0))

    async def go() -> None:
        await engine.start()
        engine._run_step = engine._fresh_cache = _oom
        reqs = [GenerateRequest(p, SP) for p in prompts([4, 5, 6])]  # one slot: two of them wait
        outs = await asyncio.wait_for(asyncio.gather(*(engine.generate(r) for r in reqs)), 60)
        assert [o.finish_reason.get("status_code") for o in outs] == [500] * 3
        assert engine.num_live == 0
        await engine.stop()

    run(go())
