"""The compile clock counts this thread's tracing and compiling, once per second, and a train
step reports it as ``compile_seconds``."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.compile_clock import compile_clock, merged_seconds
from tests.trainer.helpers import random_trajectories, tiny_model


def test_overlapping_spans_count_once() -> None:
    spans = [(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (3.2, 3.5), (2.0, 2.5)]
    assert merged_seconds(spans) == 3.5  # [0, 2.5] and [3, 4]
    assert merged_seconds([]) == 0.0


def _fresh_function():
    # A new Python function each call, so jit's cache never has it.
    def f(x):
        for _ in range(20):
            x = jnp.sin(x) @ x.T
        return x
    return jax.jit(f)


def test_a_new_shape_is_timed_and_a_cached_one_is_not() -> None:
    f, x = _fresh_function(), jnp.ones((16, 16))
    start = time.perf_counter()
    with compile_clock() as first:
        f(x).block_until_ready()
    wall = time.perf_counter() - start
    assert 0.0 < first.seconds <= wall
    with compile_clock() as second:
        f(x).block_until_ready()
    assert second.seconds == 0.0
    with compile_clock() as outer:
        with compile_clock() as inner:
            f(jnp.ones((8, 8))).block_until_ready()  # a new shape: traced and compiled again
    assert inner.seconds > 0.0 and outer.seconds == inner.seconds


def test_another_threads_compiling_is_not_counted() -> None:
    started, done = threading.Event(), threading.Event()

    def other() -> None:
        started.set()
        _fresh_function()(jnp.ones((24, 24))).block_until_ready()
        done.set()

    with compile_clock() as mine:
        worker = threading.Thread(target=other)
        worker.start()
        started.wait()
        done.wait(timeout=120)
    worker.join()
    assert done.is_set() and mine.seconds == 0.0


def test_train_batch_reports_its_compile_seconds() -> None:
    rng = np.random.default_rng(0)
    trainer = Trainer(tiny_model(), AlgoConfig(adv_estimator="grpo"),
                      TrainConfig(lr=1e-4, micro_batch_tokens=256, length_buckets=(256,)))
    batch = random_trajectories(rng, 2, 4)
    first = trainer.train_batch(batch, 0)
    again = trainer.train_batch(batch, 1)
    assert 0.0 < first["compile_seconds"] <= first["time_s"]
    # The same shapes again: nothing new to compile, so (almost) nothing is counted.
    assert again["compile_seconds"] < 0.1 * first["compile_seconds"]
