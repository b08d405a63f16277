"""The staleness rule against its formula, and the controller's bound over random interleavings."""

import asyncio
import random

import numpy as np
import pytest

from areal_jax.controller import RolloutController, StalenessRule
from areal_jax.data.trajectory import Trajectory


@pytest.mark.parametrize("seed", range(20))
def test_rule_matches_formula_over_random_interleavings(seed: int) -> None:
    rng = random.Random(seed)
    b, eta, cap = rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 12)
    rule = StalenessRule(batch_size=b, max_staleness=eta, max_concurrent=cap)
    accepted = running = version = steps = 0
    for _ in range(400):
        op = rng.choice(["submit", "finish", "finish", "bump", "skip"])
        allowed = accepted + running < (eta + steps + 1) * b and running < cap
        assert rule.can_submit() == allowed
        if op == "submit" and allowed:
            rule.on_submit()
            running += 1
        elif op == "submit":
            with pytest.raises(RuntimeError):
                rule.on_submit()
        elif op == "finish" and running:
            ok = rng.random() < 0.8
            rule.on_finish(ok)
            running -= 1
            accepted += ok
        elif op in ("bump", "skip") and accepted >= (steps + 1) * b:  # the trainer consumed a batch
            steps += 1
            version += op == "bump"  # a step whose every update was skipped makes no new version
            rule.set_version(version, steps)
        assert (rule.accepted, rule.running, rule.version, rule.steps) == (accepted, running, version, steps)


def test_rule_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessRule(batch_size=2, max_staleness=-1, max_concurrent=4)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessRule(batch_size=0, max_staleness=1, max_concurrent=4)


class _Row:
    def __init__(self, i: int):
        self.id = f"row-{i}"


def _make_workflow(policy: dict, rng: random.Random, group_size: int):
    """Answers whose tokens are stamped with the policy version current when each was sampled:
    an episode that spans weight updates holds several versions, as an interrupted rollout does."""

    async def episode(client, row):
        out = []
        for _ in range(group_size):
            versions = []
            for _ in range(rng.randint(1, 6)):
                await asyncio.sleep(rng.random() * 0.004)
                versions.append(policy["version"])
            n = len(versions)
            out.append(Trajectory.from_prompt_and_answer(np.arange(3), np.arange(n), -np.ones(n), np.array(versions),
                                                         reward=rng.random(), group_id=0))
        return out

    return episode


@pytest.mark.parametrize("seed,eta", [(0, 0), (1, 1), (2, 2), (3, 4), (4, 1), (5, 3)])
def test_controller_batches_never_exceed_the_bound(seed: int, eta: int) -> None:
    rng = random.Random(seed)
    batch, steps = 3, 12

    async def run() -> list[int]:
        policy = {"version": 0}
        ctl = RolloutController(None, _make_workflow(policy, rng, 2), iter(_Row(i) for i in range(10_000)),
                                batch_size=batch, max_staleness=eta, max_concurrent=rng.randint(2, 12))
        ctl.start()
        worst = []
        for v in range(steps):
            groups = await ctl.get_batch(timeout=30)
            assert len(groups) == batch
            stale = [v - t.versions[t.loss_mask > 0].min() for g in groups for t in g.trajectories]
            assert max(stale) <= eta, f"step {v}: staleness {max(stale)} > {eta}"
            # the capacity formula holds at every moment we look
            assert ctl.rule.accepted + ctl.rule.running <= (eta + v + 1) * batch
            await asyncio.sleep(rng.random() * 0.01)  # the trainer works
            policy["version"] = v + 1
            ctl.set_version(v + 1)
            worst.append(max(stale))
        await ctl.stop()
        return worst

    worst = asyncio.run(run())
    if eta == 0:
        assert worst == [0] * steps  # synchronous: every token from the current policy
    else:
        assert max(worst) >= 1  # asynchronous: rollout does run ahead of the trainer


@pytest.mark.parametrize("eta", [0, 2])
def test_steps_that_make_no_new_version_still_free_room(eta: int) -> None:
    """Every other step's updates are all skipped (no new version): rollout must keep filling
    batches (counting room by version stalled the run at the first skipped step in sync mode),
    and what it hands out stays within the bound of the version."""
    rng = random.Random(eta)
    batch = 2

    async def run() -> None:
        policy = {"version": 0}
        ctl = RolloutController(None, _make_workflow(policy, rng, 2), iter(_Row(i) for i in range(10_000)),
                                batch_size=batch, max_staleness=eta)
        ctl.start()
        version = 0
        for step in range(1, 9):
            groups = await ctl.get_batch(timeout=10)
            assert max(version - t.versions[t.loss_mask > 0].min() for g in groups for t in g.trajectories) <= eta
            version += step % 2  # even steps skip every update
            policy["version"] = version
            ctl.set_version(version, step)
        assert (ctl.rule.version, ctl.rule.steps) == (4, 8)
        await ctl.stop()

    asyncio.run(run())
    with pytest.raises(ValueError, match="after only"):
        StalenessRule(batch_size=1, max_staleness=0, max_concurrent=1).set_version(2, 1)


def test_dynamic_filtering_drops_uniform_groups_and_gives_up_loudly() -> None:
    rewards = iter([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]] + [[0.0, 0.0]] * 100)

    async def episode(client, row):
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), 0, reward=r, group_id=0)
                for r in next(rewards)]

    async def run():
        ctl = RolloutController(None, episode, iter(_Row(i) for i in range(10_000)), batch_size=1, max_staleness=0,
                                filter_uniform_reward=True, filter_patience=30)
        ctl.start()
        batch = await ctl.get_batch(timeout=10)
        assert [t.reward for t in batch[0].trajectories] == [0.0, 1.0]  # the one group with signal
        ctl.set_version(1)
        with pytest.raises(RuntimeError, match="equal rewards.*filter_uniform_reward=false"):
            await ctl.get_batch(timeout=10)
        assert ctl.counters.filtered >= 31 and ctl.counters.accepted == 1
        await ctl.stop()

    asyncio.run(run())


def test_drain_waits_for_episodes_in_flight_and_starts_none_until_resume() -> None:
    """The non-interruptible weight update: ``drain`` returns only when no episode runs, and no
    episode starts between ``drain`` and ``resume``."""
    log: list[tuple[str, str]] = []

    async def episode(client, row):
        log.append(("start", row.id))
        await asyncio.sleep(0.02)
        log.append(("end", row.id))
        return [Trajectory.from_prompt_and_answer(np.arange(3), np.arange(2), -np.ones(2), 0, reward=1.0, group_id=0)]

    async def run() -> None:
        ctl = RolloutController(None, episode, iter(_Row(i) for i in range(10_000)), batch_size=2, max_staleness=1000,
                                max_concurrent=3)
        ctl.start()
        await asyncio.sleep(0.005)
        assert ctl.rule.running > 0  # episodes are in flight when the drain begins
        await ctl.drain()
        assert ctl.rule.running == 0 and not ctl._tasks
        started, ended = ({r for k, r in log if k == what} for what in ("start", "end"))
        assert started == ended  # every episode that started has finished
        mark = len(log)
        await asyncio.sleep(0.05)
        assert len(log) == mark  # nothing started while drained, though capacity is free
        ctl.resume()
        await asyncio.sleep(0.01)
        assert any(k == "start" for k, _ in log[mark:])
        await ctl.stop()

    asyncio.run(run())
