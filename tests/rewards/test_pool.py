"""The reward pool survives rewards that hang, raise, exit or eat memory: each scores 0 and is
counted, the worker is replaced, and normal calls interleaved with them return their values."""

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.rewards import RewardConfig, RewardPool, get_reward_fn


@pytest.fixture(scope="module")
def bad_pool():
    cfg = RewardConfig(name="tests.rewards.fns:misbehave", num_workers=2, timeout_s=3.0, memory_mb=1024)
    with RewardPool(cfg) as pool:
        yield pool


@pytest.mark.parametrize("completion,stat,message", [
    ("sleep", "timeouts", "timed out after 3.0s"),
    ("raise", "errors", "RuntimeError: the reward function broke"),
    ("exit", "worker_died", "worker died"),
    ("oom", "memory", "ran out of memory (limit 1024 MiB)"),
    ("bad_type", "errors", "must return a float"),
])
def test_each_failure_scores_zero_is_counted_and_the_pool_goes_on(bad_pool, completion, stat, message) -> None:
    async def run():
        before = bad_pool.stats[stat]
        r = await bad_pool.score("p", completion, {}, row_id=f"row-{completion}")
        assert r.reward == 0.0 and message in r.error
        assert bad_pool.stats[stat] == before + 1
        after = await bad_pool.score("p", "fine", {}, row_id="after")  # a replaced worker still scores
        assert after.reward == 1.0 and after.error is None

    asyncio.run(run())


@pytest.mark.slow
def test_normal_calls_interleaved_with_failures_all_return_their_values(bad_pool) -> None:
    async def run():
        with RewardPool(RewardConfig(name="tests.rewards.fns:echo", num_workers=2)) as ok:
            rng = random.Random(0)
            normal = [(f"x{'y' * rng.randint(0, 20)}", rng.random()) for _ in range(200)]
            bad = ["sleep", "raise", "exit", "oom", "bad_type"]
            calls = [bad_pool.score("p", bad[i // 40], {}, row_id=f"bad-{i}") if i % 40 == 0  # interleaved
                     else ok.score("p", c, {"value": v}, row_id=f"n{i}") for i, (c, v) in enumerate(normal)]
            results = await asyncio.gather(*calls)
            for i, r in enumerate(results):
                if i % 40 == 0:
                    assert r.reward == 0.0 and r.error, (i, r)
                else:
                    c, v = normal[i]
                    assert r.error is None and r.reward == pytest.approx(v + len(c)) and r.extra["length"] == len(c)
            assert ok.stats["ok"] == 195 and ok.stats["failed"] == 0

    asyncio.run(run())


def test_unknown_reward_fails_before_work() -> None:
    with pytest.raises(ValueError, match="reward.name='no_such.module:fn'.*built-in rewards are"):
        get_reward_fn("no_such.module:fn")
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardConfig(num_workers=0)


def test_a_pool_whose_workers_cannot_start_names_the_missing_main_guard(tmp_path) -> None:
    """A script that builds the pool without ``if __name__ == "__main__":``: the forkserver's
    workers import it and fail, and each call scores 0 with a message that names the guard."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import asyncio\n"
        "from areal_jax.rewards import RewardConfig, RewardPool\n"
        "pool = RewardPool(RewardConfig(name='tests.rewards.fns:echo', num_workers=1))\n"
        "r = asyncio.run(pool.score('p', 'x', {}, row_id='r'))\n"
        "print('RESULT', r.reward, pool.stats['pool_broken'], r.error)\n"
        "pool.close()\n")
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                          env=env)
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result, proc.stderr[-2000:]
    assert result[0].startswith("RESULT 0.0 1 ") and 'if __name__ == "__main__":' in result[0]
    assert "could not start" in proc.stderr  # logged as an error, once
