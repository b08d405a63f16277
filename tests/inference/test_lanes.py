"""Lanes: how many an engine picks, that two lanes give exactly what one lane gives, and that
their compiled calls really run at the same time."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference import config as config_mod
from areal_jax.models.hf_io import load_pretrained
from tests.inference.conftest import ENGINE_CFG
from tests.inference.reference import generate_all, prompts, run


@pytest.mark.parametrize(("num_slots", "backend", "mesh", "cpus", "lanes"), [
    (32, "cpu", False, 2, 2), (16, "cpu", False, 8, 2), (4, "cpu", False, 2, 2), (2, "cpu", False, 2, 1),
    (17, "cpu", False, 2, 1),
    (32, "cpu", False, 1, 1), (32, "cpu", True, 2, 1), (32, "tpu", False, 8, 1), (32, "gpu", False, 8, 1)])
def test_automatic_lane_count(monkeypatch: pytest.MonkeyPatch, num_slots: int, backend: str, mesh: bool,
                              cpus: int, lanes: int) -> None:
    monkeypatch.setattr(config_mod, "usable_cpus", lambda: cpus)
    assert EngineConfig(num_slots=num_slots).resolve_lanes(backend, mesh) == lanes


def test_bad_lane_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="lanes=3 must be >= 1 and divide num_slots=8"):
        EngineConfig(num_slots=8, lanes=3)
    with pytest.raises(ValueError, match="lanes=0"):
        EngineConfig(num_slots=8, lanes=0)
    with pytest.raises(ValueError, match="lanes=2 needs mesh=None"):
        EngineConfig(num_slots=8, lanes=2).resolve_lanes("cpu", has_mesh=True)
    assert EngineConfig(num_slots=8, lanes=1).resolve_lanes("cpu", has_mesh=True) == 1


def _requests() -> list[GenerateRequest]:
    ps = prompts([3, 9, 17, 30, 5, 12, 8, 21, 4, 14], seed=5)  # more prompts than slots
    greedy = SamplingParams(max_new_tokens=14, temperature=0, ignore_eos=True)
    return [GenerateRequest(p, greedy if i % 2 else SamplingParams(max_new_tokens=14, seed=i, top_p=0.9,
                                                                   ignore_eos=True))
            for i, p in enumerate(ps)]


def test_two_lanes_equal_one_lane(slot_engine: Engine, ckpt: Path) -> None:
    assert slot_engine.num_lanes == 2 and slot_engine.lane_slots == 4
    single = Engine(load_pretrained(ckpt), EngineConfig(**{**vars(ENGINE_CFG), "lanes": 1}))
    assert single.num_lanes == 1
    ours, theirs = generate_all(slot_engine, _requests()), generate_all(single, _requests())
    for a, b in zip(ours, theirs, strict=True):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)


def test_lanes_fill_and_step_concurrently(slot_engine: Engine) -> None:
    # The first two step calls meet at a barrier: they get past it only if both are in flight at
    # once (two lanes stepping concurrently); calls made one after another would break it.
    barrier, calls, lock = threading.Barrier(2, timeout=120), [0], threading.Lock()
    met: list[bool] = []
    real = slot_engine._run_step
    # The answers each lane stepped, by stream id, over the whole run (read at each of its step
    # calls, not at one moment: on a loaded machine one lane may finish its answers before the
    # other lane's first tokens are out).
    stepped: list[set[int]] = [set() for _ in slot_engine._lanes]

    def meeting(fn, *args, **kwargs):  # noqa: ANN001, ANN202
        with lock:
            calls[0] += 1
            first_two = calls[0] <= 2
            for k, lane in enumerate(slot_engine._lanes):
                if lane.cache is args[1]:
                    stepped[k] |= {s.stream_id for s in lane.running}
        if first_two:
            try:
                barrier.wait()
                met.append(True)
            except threading.BrokenBarrierError:
                met.append(False)
        return real(fn, *args, **kwargs)

    slot_engine._run_step = meeting
    try:
        async def go() -> None:
            await slot_engine.start()
            try:
                sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
                streams = [slot_engine.stream(GenerateRequest(p, sp)) for p in prompts([5] * 8, seed=6)]
                firsts = await asyncio.gather(*(anext(s) for s in streams))
                assert all(len(f.output_ids) >= 1 for f in firsts)
                for s in streams:
                    async for _ in s:
                        pass
            finally:
                await slot_engine.stop()
        run(go())
    finally:
        del slot_engine._run_step
    busy = [len(ids) for ids in stepped]
    assert sum(busy) == 8 and min(busy) >= 1 and not set.intersection(*stepped), stepped  # both lanes took requests
    assert met == [True, True], met  # the two lanes' calls were in flight at the same time
