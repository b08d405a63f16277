"""The reward pool survives rewards that hang, raise, exit or eat memory: each scores 0 and is
counted, the worker is replaced, and normal calls interleaved with them return their values."""

import asyncio
import random

import pytest

from areal_jax.rewards import RewardConfig, RewardPool, get_reward_fn


@pytest.mark.slow
def test_pool_survives_each_failure_and_keeps_scoring() -> None:
    async def run():
        cfg = RewardConfig(name="tests.rewards.fns:misbehave", num_workers=2, timeout_s=3.0, memory_mb=1024)
        with RewardPool(cfg) as pool, RewardPool(RewardConfig(name="tests.rewards.fns:echo", num_workers=2)) as ok:
            rng = random.Random(0)
            normal = [(f"x{'y' * rng.randint(0, 20)}", rng.random()) for _ in range(200)]
            bad = ["sleep", "raise", "exit", "oom", "bad_type"]
            calls = [pool.score("p", bad[i // 40], {}, row_id=f"bad-{i}") if i % 40 == 0  # interleaved
                     else ok.score("p", c, {"value": v}, row_id=f"n{i}") for i, (c, v) in enumerate(normal)]
            results = await asyncio.gather(*calls)
            for i, r in enumerate(results):
                if i % 40 == 0:
                    assert r.reward == 0.0 and r.error, (i, r)
                else:
                    c, v = normal[i]
                    assert r.error is None and r.reward == pytest.approx(v + len(c)) and r.extra["length"] == len(c)
            errors = {b: results[i * 40].error for i, b in enumerate(bad)}
            assert "timed out" in errors["sleep"]
            assert "RuntimeError: the reward function broke" in errors["raise"]
            assert "worker died" in errors["exit"]
            assert "memory" in errors["oom"] or "MemoryError" in errors["oom"]
            assert "must return a float" in errors["bad_type"]
            assert pool.stats["failed"] == 5 and pool.stats["timeouts"] == 1 and pool.stats["worker_died"] == 1
            after = await pool.score("p", "fine", {}, row_id="after")  # replaced workers still score
            assert after.reward == 1.0 and after.error is None

    asyncio.run(run())


def test_unknown_reward_fails_before_work() -> None:
    with pytest.raises(ValueError, match="reward.name='no_such.module:fn'.*built-in rewards are"):
        get_reward_fn("no_such.module:fn")
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardConfig(num_workers=0)
