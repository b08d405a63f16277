"""The controller's checkpoint state: a controller restored from a snapshot taken mid-run, with
groups still running and waiting, trains every prompt once: the pending ones submitted again
first, then the prompt iterator's next ones, with ``accepted = version * batch_size``."""

import asyncio
import random

import grain
import numpy as np

from areal_jax.controller import RolloutController
from areal_jax.data.trajectory import Trajectory


class _Row:
    def __init__(self, i: int):
        self.id = f"row-{i}"


def _rows() -> list[_Row]:
    return [_Row(i) for i in range(500)]


def _iterator(rows: list[_Row]):  # noqa: ANN202 - a grain DatasetIterator
    return iter(grain.MapDataset.source(rows).seed(3).shuffle().to_iter_dataset())


def _workflow(started: list[str], rng: random.Random, policy: dict):  # noqa: ANN202
    """Two answers per prompt after a random wait, their tokens stamped with the version then."""
    async def episode(client, row):
        started.append(row.id)
        await asyncio.sleep(rng.random() * 0.01)
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), policy["version"],
                                                  reward=rng.random(), group_id=0) for _ in range(2)]

    return episode


def test_restored_controller_trains_each_prompt_once() -> None:
    batch, eta, k, more = 3, 2, 4, 6
    rows = _rows()
    order = [r.id for r in _iterator(rows)]  # the iterator's sequence

    async def first_run() -> tuple[list[list[str]], dict, int]:
        policy = {"version": 0}
        ctl = RolloutController(None, _workflow([], random.Random(0), policy), _iterator(rows), batch_size=batch,
                                max_staleness=eta)
        ctl.start()
        trained = []
        for version in range(1, k + 1):
            trained.append([g.row_id for g in await ctl.get_batch(timeout=30)])
            ctl.set_version(version)
            policy["version"] = version
        while ctl.rule.running == 0 or not ctl._ready:  # snapshot with groups running and waiting
            await asyncio.sleep(0.002)
        state = ctl.state_dict()
        running = ctl.rule.running
        await ctl.stop()
        return trained, state, running

    trained, state, running = asyncio.run(first_run())
    assert state["counters"]["stale_dropped"] == 0 and state["counters"]["failed"] == 0
    pulled = state["rows"]["next_index"] if "next_index" in state["rows"] else state["counters"]["submitted"]
    assert state["counters"]["submitted"] == pulled
    pending = state["pending"]
    assert len(pending) > running > 0  # some running, some accepted and waiting
    # Every row taken from the iterator before the snapshot is trained or pending, exactly once.
    before = [i for b in trained for i in b]
    assert sorted(before + pending) == sorted(order[:pulled])

    async def resumed() -> tuple[list[list[str]], list[str], RolloutController]:
        started: list[str] = []
        policy = {"version": k}
        ctl = RolloutController(None, _workflow(started, random.Random(1), policy), _iterator(rows),
                                batch_size=batch, max_staleness=eta, version=k)
        ctl.load_state_dict(state, {r.id: r for r in rows})
        assert (ctl.rule.accepted, ctl.rule.version, ctl.rule.running) == (k * batch, k, 0)
        assert ctl.counters.submitted == state["counters"]["submitted"]
        ctl.start()
        out = []
        for version in range(k + 1, k + more + 1):
            await asyncio.sleep(0.01)  # a train step: episodes finish in between
            out.append([g.row_id for g in await ctl.get_batch(timeout=30)])
            ctl.set_version(version)
            policy["version"] = version
        await ctl.stop()
        return out, started, ctl

    after, started, ctl = asyncio.run(resumed())
    # The pending prompts go out again first, then the iterator continues where it stood.
    assert started[:len(pending)] == pending
    assert started[len(pending):] == order[pulled:pulled + len(started) - len(pending)]
    assert ctl.counters.stale_dropped == 0
    everything = before + [i for b in after for i in b]
    assert len(everything) == len(set(everything)) == (k + more) * batch  # none twice
    assert set(pending) <= set(everything)  # none lost
