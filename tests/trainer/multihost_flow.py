"""The train steps the two-process test runs, once in each of two jax.distributed processes and
once in the test's own process on as many local devices: the results must agree."""

from __future__ import annotations

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.prepare import POLICY_KEYS, fetch
from sharding import MeshConfig

MESH = MeshConfig(data=1, fsdp=2, tensor=2)


def run(mesh: Mesh, estimator: str = "grpo") -> dict[str, np.ndarray]:
    """Two train batches with a KL reference (the proximal recompute, reference logprobs gathered
    back to the host, advantages, two minibatches each; with ``estimator='gae'`` also the critic's
    values gathered back and its updates): the first minibatch's gradient, every step's
    statistics and the params after, all gathered whole."""
    from tests.trainer.helpers import random_trajectories, tiny_model

    trainer = Trainer(tiny_model(seed=3), AlgoConfig(ppo_n_minibatches=2, kl_coef=0.1, adv_estimator=estimator),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64), lr=1e-2), mesh=mesh)
    assert trainer.dp_groups == 2
    out: dict[str, np.ndarray] = {}
    prepared = trainer.prepare_batch(random_trajectories(np.random.default_rng(0), 4, 2), 0)
    first = prepared.minibatches[0]
    grads, _ = trainer.minibatch_grads([m.inputs((*POLICY_KEYS, "proximal_logprobs")) for m in first], 0,
                                       units=[m.loss_units for m in first])
    for path, g in nnx.to_flat_state(fetch(grads)):
        out["grad/" + "/".join(map(str, path))] = np.asarray(g.get_value())
    stats = [trainer.train_prepared(prepared),
             trainer.train_batch(random_trajectories(np.random.default_rng(1), 4, 2), 1)]
    for i, st in enumerate(stats):
        keys = ["loss", "grad_norm", "kl_ref_mean", "entropy", "behavior_imp_weight_mean", "lr"]
        if estimator == "gae":
            keys += ["value_loss", "critic_grad_norm", "explained_variance", "value_mean"]
        for key in keys:
            out[f"stats{i}/{key}"] = np.float64(st[key])
    critic = trainer.critic_learner
    params = {"param": trainer.policy.params, "critic": None if critic is None else critic.params}
    for name, tree in params.items():
        if tree is not None:
            for path, p in nnx.to_flat_state(fetch(tree)):
                out[f"{name}/" + "/".join(map(str, path))] = np.asarray(p.get_value())
    return out
