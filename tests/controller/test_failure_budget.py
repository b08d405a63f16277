"""A workflow that always fails ends the run instead of hanging it: after ``failure_patience``
episodes in a row fail, ``get_batch`` raises with the first failure's traceback, and the
controller stops taking prompts (an agent that always raised burned 31,292 prompts in 5 s while
the trainer waited for ever). Occasional failures below the budget are counted and skipped."""

import asyncio

import numpy as np
import pytest

from areal_jax.controller import RolloutController
from areal_jax.data.trajectory import Trajectory


class _Row:
    def __init__(self, i: int):
        self.id = f"row-{i}"
        self.i = i


def _broken_tool(row):
    raise KeyError(f"no tool for {row.id}")


async def always_fails(client, row):
    await asyncio.sleep(0)
    _broken_tool(row)


def test_a_workflow_that_always_fails_ends_the_run_with_the_first_traceback() -> None:
    async def run() -> tuple[BaseException, RolloutController]:
        ctl = RolloutController(None, always_fails, iter(_Row(i) for i in range(100_000)), batch_size=2,
                                max_staleness=1, failure_patience=8)
        ctl.start()
        try:
            with pytest.raises(RuntimeError) as info:
                await ctl.get_batch()  # no timeout: the old controller waited here for ever
            await asyncio.sleep(0.05)  # no more prompts are taken after the budget is spent
            return info.value, ctl
        finally:
            await ctl.stop()

    err, ctl = asyncio.run(asyncio.wait_for(run(), 120))  # the bound turns a hang into a failure
    msg = str(err)
    assert "8 episodes in a row failed" in msg and "rollout.failure_patience" in msg
    assert "row-0" in msg  # the first failure, with its traceback down to the raising line
    assert "Traceback" in msg and "_broken_tool" in msg and "KeyError" in msg
    assert isinstance(err.__cause__, KeyError)
    # in flight when the budget ran out: at most (max_staleness + 1) * batch_size more
    assert 8 <= ctl.counters.failed <= 8 + 4
    assert ctl.counters.submitted - ctl.counters.failed <= 1  # one may have been read as the budget ran out


def test_failures_below_the_budget_are_skipped() -> None:
    policy = {"version": 0}

    async def flaky(client, row):
        await asyncio.sleep(0)
        if row.i % 3 == 0:
            raise ValueError("flaky")
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), policy["version"],
                                                  reward=float(k), group_id=0) for k in range(2)]

    async def run() -> RolloutController:
        ctl = RolloutController(None, flaky, iter(_Row(i) for i in range(1000)), batch_size=2, max_staleness=0,
                                failure_patience=2)
        ctl.start()
        try:
            for v in range(1, 6):
                assert len(await ctl.get_batch()) == 2
                policy["version"] = v
                ctl.set_version(v)
            return ctl
        finally:
            await ctl.stop()

    ctl = asyncio.run(asyncio.wait_for(run(), 120))
    assert ctl.counters.failed >= 3


def test_failure_patience_is_checked() -> None:
    with pytest.raises(ValueError, match="failure_patience"):
        RolloutController(None, always_fails, iter([]), batch_size=2, max_staleness=1, failure_patience=0)
