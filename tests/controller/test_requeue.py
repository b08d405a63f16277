"""Prompts the controller could not train are not lost: a group dropped for being staler than
the bound has its prompt submitted again (counted), so over one epoch every prompt is trained
on exactly once, long answers included (dropping them for good biased training towards the
prompts with short answers, the ones that finish before they go stale). And the controller
misses no wakeup: the last batch and the end of the prompts are seen as they happen (a shared
event, cleared by whichever waiter woke first, left ``get_batch`` asleep with a full batch
ready, and at the end of an epoch for good)."""

import asyncio

import numpy as np
import pytest

from areal_jax.controller import PromptsExhausted, RolloutController
from areal_jax.data.trajectory import Trajectory


class _Row:
    def __init__(self, i: int):
        self.id = f"row-{i}"
        # a long answer: it outlives two weight updates on its first try (early rows only, so that
        # later ones keep the versions moving)
        self.long = i % 4 == 1 and i < 12


def _workflow(policy: dict, changed: asyncio.Condition, tries: dict):
    async def episode(client, row):
        tries[row.id] = tries.get(row.id, 0) + 1
        started = policy["version"]
        if row.long and tries[row.id] == 1:
            async with changed:  # wait for two updates: then it is 2 > max_staleness versions old
                await changed.wait_for(lambda: policy["version"] >= started + 2)
        else:
            await asyncio.sleep(0)
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), started,
                                                  reward=float(i), group_id=0) for i in range(2)]

    return episode


@pytest.mark.parametrize("batch", [2, 3])
def test_every_prompt_of_an_epoch_is_trained_once_though_some_went_stale(batch: int) -> None:
    rows = [_Row(i) for i in range(24)]

    async def run() -> tuple[list[str], RolloutController, dict]:
        policy, changed, tries = {"version": 0}, asyncio.Condition(), {}
        ctl = RolloutController(None, _workflow(policy, changed, tries), iter(rows), batch_size=batch,
                                max_staleness=1)
        ctl.start()
        trained: list[str] = []
        try:
            while True:
                groups = await ctl.get_batch()  # no timeout: a lost wakeup hangs here
                assert all(policy["version"] - g.oldest_version <= 1 for g in groups)
                trained += [g.row_id for g in groups]
                async with changed:
                    policy["version"] += 1
                    changed.notify_all()
                ctl.set_version(policy["version"])
        except PromptsExhausted:
            pass
        finally:
            await ctl.stop()
        return trained, ctl, tries

    # The bound only turns a hang into a failure; the run takes well under a second.
    trained, ctl, tries = asyncio.run(asyncio.wait_for(run(), 120))
    c = ctl.counters
    assert c.stale_dropped > 0  # the probe did make long answers go stale
    assert c.stale_requeued == c.stale_dropped
    assert sorted(trained) == sorted(r.id for r in rows)  # each prompt once, none lost
    assert c.submitted == len(rows)  # a requeue is not a new prompt
    assert sum(tries.values()) == len(rows) + c.stale_requeued


def test_state_dict_counts_requeued_prompts_as_pending() -> None:
    """A checkpoint taken while a dropped prompt waits to be submitted again keeps it."""
    rows = [_Row(1), _Row(2), _Row(3), _Row(5), _Row(6), _Row(7), _Row(9)]

    async def run() -> dict:
        policy, changed, tries = {"version": 0}, asyncio.Condition(), {}
        ctl = RolloutController(None, _workflow(policy, changed, tries), iter(rows), batch_size=1,
                                max_staleness=1, max_concurrent=3)
        ctl.start()
        for _ in range(2):
            await ctl.get_batch(timeout=30)
            async with changed:
                policy["version"] += 1
                changed.notify_all()
            ctl.set_version(policy["version"])
        ctl._held = True  # no new submissions: what was dropped stays queued for resubmission
        while not any(g.row_id == "row-1" for g in ctl._ready):
            await asyncio.sleep(0.001)
        ctl._drop_stale()
        state = ctl.state_dict()
        await ctl.stop()
        return state

    state = asyncio.run(run())
    assert state["counters"]["stale_requeued"] == 1
    assert state["pending"][0] == "row-1"


def test_a_prompt_that_always_goes_stale_is_given_up_after_a_few_tries() -> None:
    """Its answers outlast the bound every time (here: stamped one version behind): it is
    submitted again ``MAX_STALE_REQUEUES`` times, then dropped and counted, and the run goes on
    (it was generated for ever before)."""
    from areal_jax.controller.controller import MAX_STALE_REQUEUES

    rows = [_Row(0), _Row(2), _Row(3), _Row(4), _Row(6), _Row(7), _Row(8), _Row(10), _Row(11)]
    rows[2].id = "doomed"

    async def episode(client, row):
        await asyncio.sleep(0)
        version = max(0, policy["version"] - 1) if row.id == "doomed" else policy["version"]
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), version,
                                                  reward=float(i), group_id=0) for i in range(2)]

    policy = {"version": 0}

    async def run() -> tuple[list[str], RolloutController]:
        ctl = RolloutController(None, episode, iter(rows), batch_size=1, max_staleness=0)
        ctl.start()
        trained = []
        try:
            while True:
                trained += [g.row_id for g in await ctl.get_batch()]
                policy["version"] += 1
                ctl.set_version(policy["version"])
        except PromptsExhausted:
            return trained, ctl
        finally:
            await ctl.stop()

    trained, ctl = asyncio.run(asyncio.wait_for(run(), 120))
    assert sorted(trained) == sorted(r.id for r in rows if r.id != "doomed")
    c = ctl.counters
    assert (c.stale_requeued, c.stale_abandoned, c.stale_dropped) == (MAX_STALE_REQUEUES, 1, MAX_STALE_REQUEUES + 1)
