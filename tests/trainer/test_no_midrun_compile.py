"""With ``train.compile_warmup`` off, a run compiles its step at step 1 and not again for
batches of the shapes it has met. The update after a weight push was the exception: the push
lends the params, and the update that keeps lent params is a second compiled program, which
compiled inside step 2 (2.4-3.8 s on this CPU in a small GRPO run). ``Learner.lend`` now
compiles it in the background, where the push and generation run."""

import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from tests.trainer.helpers import random_trajectories, tiny_model


def test_step_after_a_lend_compiles_nothing() -> None:
    trainer = Trainer(tiny_model(), AlgoConfig(), TrainConfig(lr=1e-3))
    assert trainer.train.micro_batch_tokens == 1024  # auto on CPU
    trajs = random_trajectories(np.random.default_rng(3), 2, 4)
    first = trainer.train_batch(trajs, 0)
    assert first["compile_seconds"] > 0  # step 1 compiles (warm-up off)
    lent = trainer.policy.lend()  # as the weight push after step 1 does
    keep = getattr(trainer.policy, "_keep_compiled", None)
    if keep is not None:  # the background compile, finished (a weight push takes as long)
        keep.result()
    second = trainer.train_batch(trajs, 1)
    assert second["compile_seconds"] == 0.0
    # the lent params survived the update (not donated), and the update took effect
    import jax

    before, after = np.asarray(jax.tree.leaves(lent)[0]), np.asarray(jax.tree.leaves(trainer.policy.params)[0])
    assert np.isfinite(before).all() and not np.array_equal(before, after)
