"""The run's start: step 1 compiles nothing that could have been compiled while its batch was
generated, and the start-up timeline says where the seconds went."""

import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.startup import StartupTimeline
from tests.trainer.helpers import random_trajectories, tiny_model


def test_first_step_compiled_ahead_compiles_nothing() -> None:
    """``compile_first_step`` with the longest lengths the first batch can hold compiles what that
    batch runs (packing, advantages, forward and gradients, the optimizer step); the real batch,
    shorter, then compiles nothing. Before, step 1 compiled its gradient and optimizer steps
    itself (6 s and 2 s of a small run's step 1 on this CPU)."""
    trainer = Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=2), TrainConfig(lr=1e-3))
    trajs = random_trajectories(np.random.default_rng(3), 2, 4, prompt_len=(3, 10), answer_len=(2, 16))
    longest = 9 + 15  # the helper's longest prompt and answer
    ahead = trainer.compile_first_step([longest] * len(trajs), group_size=4).result()
    assert ahead["compile_seconds"] > 0 and ahead["micro_batches"] >= 2
    first = trainer.train_batch(trajs, 0)
    assert first["compile_seconds"] == 0.0
    assert np.isfinite(first["loss"])


def test_timeline_spans_in_order_of_start() -> None:
    t = StartupTimeline(t0=100.0)
    t.add("b", 103.0, 104.5)
    t.add("a", 101.0, 102.0)
    assert list(t.as_dict()) == ["a", "b"] and t.as_dict()["b"] == [3.0, 4.5]
    assert "(  1.5s)  b" in t.describe()


def test_servers_get_the_compile_cache_and_an_earlier_setting_wins(tmp_path) -> None:
    """A cache already set (here the suite's ``JAX_COMPILATION_CACHE_DIR``) is kept over the
    config's, and the servers a run starts get the one in use through their environment."""
    import os

    from areal_jax.trainer.startup import compile_cache_env, use_compile_cache

    suite = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert use_compile_cache(str(tmp_path / "elsewhere")) == suite
    assert compile_cache_env()["JAX_COMPILATION_CACHE_DIR"] == suite
    assert not (tmp_path / "elsewhere").exists()



def test_the_bench_s_own_cache_wins_and_its_servers_inherit_it(tmp_path, monkeypatch) -> None:
    """``override`` (the bench's cache in its output folder) replaces the one in use, and the
    environment that child processes start from names it; the suite's is restored after."""
    import os

    import jax

    from areal_jax.trainer.startup import use_compile_cache

    before = jax.config.jax_compilation_cache_dir
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    try:
        bench = tmp_path / "bench_cache"
        assert use_compile_cache(str(bench), override=True) == str(bench)
        assert jax.config.jax_compilation_cache_dir == str(bench) and bench.is_dir()
        assert os.environ["JAX_COMPILATION_CACHE_DIR"] == str(bench)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)

def test_a_server_waiting_for_its_model_gives_up_naming_the_flag(tmp_path) -> None:
    import pytest

    from rollout_bridge.serve import wait_for_model

    with pytest.raises(SystemExit, match="did not appear within --wait-for-model 0.1s"):
        wait_for_model(tmp_path / "base", 0.1)
