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


def test_a_pool_whose_workers_cannot_start_stops_the_run_naming_the_missing_main_guard(tmp_path) -> None:
    """A script that builds the pool without ``if __name__ == "__main__":``: the forkserver's
    workers import it and fail. A call raises ``RewardPoolBroken`` naming the guard (not a 0 that
    would look like a wrong answer), and a controller whose episodes score through that pool
    stops with it instead of running on (or waiting forever for groups with a reward)."""
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import asyncio\n"
        "from types import SimpleNamespace\n"
        "from areal_jax.controller import EpisodeClient, RolloutController\n"
        "from areal_jax.rewards import RewardConfig, RewardPool, RewardPoolBroken\n"
        # a worker imports this file as __mp_main__ and fails at the first call: the pool breaks
        "pool = RewardPool(RewardConfig(name='tests.rewards.fns:echo', num_workers=1))\n"
        "try:\n"
        "    asyncio.run(pool.score('p', 'x', {}, row_id='r'))\n"
        "except RewardPoolBroken as e:\n"
        "    if __name__ != '__main__':\n"
        "        raise  # in a worker, importing this file: its import fails\n"
        "    print('RAISED', pool.stats['pool_broken'], e)\n"
        "client = EpisodeClient(rollout=None, tokenizer=None, reward_pool=pool, sampling={})\n"
        "async def episode(client, row):\n"
        "    await client.reward(row, 'x')\n"
        "    raise AssertionError('a broken pool returned a score')\n"
        "async def run():\n"
        "    rows = iter(SimpleNamespace(id=f'q{i}', prompt='p', reward_fields={}) for i in range(1000))\n"
        "    ctl = RolloutController(client, episode, rows, batch_size=2, max_staleness=0)\n"
        "    ctl.start()\n"
        "    try:\n"
        "        await ctl.get_batch(timeout=120)\n"
        "    except RuntimeError as e:\n"
        "        print('STOPPED', ctl.counters.failed, pool.stats['pool_broken'], e)\n"
        "    await ctl.stop()\n"
        "asyncio.run(run())\n"
        "pool.close()\n")
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root,
                          env=env)
    lines = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    assert "RAISED" in lines and "STOPPED" in lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert lines["RAISED"].startswith("RAISED 1 ") and 'if __name__ == "__main__":' in lines["RAISED"]
    stopped = lines["STOPPED"]
    assert "rollout stopped: reward pool 'tests.rewards.fns:echo'" in stopped and "__main__" in stopped
    failed, refused = map(int, stopped.split()[1:3])
    assert 1 <= failed <= 2 and refused == 1 + failed  # it stopped at the first failures, not after 1000 rows
    assert "a broken pool returned a score" not in proc.stdout + proc.stderr
    assert "could not start" in proc.stderr  # logged as an error


# The injected fault kills pebble's thread on purpose; its traceback is the expected one.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_pool_that_stops_working_is_replaced_and_the_calls_in_flight_still_score() -> None:
    """pebble polls each worker's handle from one of its threads; when that raises (it did in a
    CI run, and the run then waited forever) the thread dies, the pool refuses new calls and
    the calls in flight never finish. Here a worker's handle is made invalid under a call in
    flight: the pool notices, starts a new one, and the call, and calls after it, score."""

    async def run() -> None:
        with RewardPool(RewardConfig(name="tests.rewards.fns:nap", num_workers=1, timeout_s=20)) as pool:
            assert (await pool.score("p", "x", {"seconds": 0}, row_id="warm")).reward == 1.0
            old = pool._pool
            inflight = asyncio.create_task(pool.score("p", "x", {"seconds": 2.0}, row_id="inflight"))
            await asyncio.sleep(0.5)
            worker = next(iter(old._pool_manager.worker_manager.workers.values()))
            worker._popen.sentinel = -1  # pebble's next poll of this worker raises in its thread
            await asyncio.sleep(0.5)
            assert not old.active  # the fault took: that pool no longer works
            result = await asyncio.wait_for(inflight, 60)
            assert result.error is None and result.reward == 1.0
            assert pool.stats["pool_restarts"] == 1 and pool._pool is not old
            after = await asyncio.gather(*(pool.score("p", "y", {"seconds": 0}, row_id=f"r{i}") for i in range(4)))
            assert [r.reward for r in after] == [1.0] * 4

    asyncio.run(run())


def test_closing_the_pool_ends_the_calls_in_flight_with_an_error() -> None:
    """A call in flight when the pool closes ends (scores 0, saying why) instead of starting a
    new pool after the close, or waiting forever."""

    async def run() -> None:
        pool = RewardPool(RewardConfig(name="tests.rewards.fns:nap", num_workers=1, timeout_s=20))
        assert (await pool.score("p", "x", {"seconds": 0}, row_id="warm")).reward == 1.0
        inflight = asyncio.create_task(pool.score("p", "x", {"seconds": 5.0}, row_id="inflight"))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(pool.close)
        result = await asyncio.wait_for(inflight, 30)
        assert result.reward == 0.0 and result.error == "the reward pool was closed"
        assert pool.stats["pool_restarts"] == 0

    asyncio.run(run())
