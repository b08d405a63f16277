"""The in-process client on engine failures and aborts, as the HTTP client behaves: an engine
error is not a pause (re-submitted at most ``max_error_resends`` times, then a ``RolloutError``
with the engine's message), a dead engine raises at once, and an abort is never lost between
two segments nor kept for a rid that is not being generated. Faults are injected into a real
engine's step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_jax.inference import Engine, EngineConfig
from areal_jax.models import load_pretrained
from rollout_bridge.client import ClientConfig, RolloutError
from rollout_bridge.local import LocalRolloutClient

SP = {"max_new_tokens": 6, "ignore_eos": True}


def _engine(tiny_dir: Path, **kw: object) -> Engine:
    model = load_pretrained(tiny_dir)
    return Engine(model, EngineConfig(num_slots=2, max_seq_len=64, lanes=1, seed=0, **kw))


def test_an_engine_error_is_resent_a_bounded_number_of_times_then_raised(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)
    calls = []

    def failing_step(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("INTERNAL: injected step failure")

    cfg = ClientConfig(max_error_resends=2, error_backoff_s=0.001)

    async def main() -> None:
        async with LocalRolloutClient(engine, config=cfg) as client:
            engine._run_step = failing_step  # every step fails; the lane recovers each time
            with pytest.raises(RolloutError, match="INTERNAL: injected step failure.*gave up after 3 engine errors"):
                await client.generate([3, 4, 5], SP)
            assert len(calls) == 3  # one try and two re-sends, not max_resends (1,000) of them
            del engine._run_step
            r = await client.generate([3, 4, 5], SP)  # the engine still serves
            assert len(r.output_ids) == 6

    asyncio.run(main())


def test_a_dead_engine_raises_at_once(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)

    def oom(*args: object, **kwargs: object) -> None:
        raise MemoryError("RESOURCE_EXHAUSTED: injected")

    async def main() -> None:
        async with LocalRolloutClient(engine, config=ClientConfig(error_backoff_s=0.001)) as client:
            engine._run_step = engine._fresh_cache = oom
            with pytest.raises(RolloutError, match="engine is dead|RESOURCE_EXHAUSTED"):
                await client.generate([3, 4, 5], SP)
            assert not (await client.check_health())[0]

    asyncio.run(main())


def test_an_abort_between_segments_is_not_lost_and_unknown_rids_are_not_kept(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir)

    def failing_step(*args: object, **kwargs: object) -> None:
        raise RuntimeError("INTERNAL: injected step failure")

    async def main() -> None:
        cfg = ClientConfig(error_backoff_s=3600)  # a failed segment would be re-sent in an hour
        async with LocalRolloutClient(engine, config=cfg) as client:
            await client.abort("never-sent")  # ignored, and not held against a later request with this rid
            engine._run_step = failing_step
            backing_off = asyncio.create_task(client.generate([3, 4], SP, rid="later"))
            while "later" not in client._live or client._live["later"].sub is not None:
                await asyncio.sleep(0.01)  # its segment failed: backing off before the re-send
            await client.abort("later")
            r = await asyncio.wait_for(backing_off, 60)  # at once, not after the back-off
            assert r.finish_reason["type"] == "abort" and r.output_ids == []
            del engine._run_step
            r = await client.generate([3, 4], SP, rid="never-sent")
            assert len(r.output_ids) == 6 and r.finish_reason["type"] == "length"
            assert client._live == {}

    asyncio.run(main())
