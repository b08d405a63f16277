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
