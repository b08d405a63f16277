"""The train steps the two-process test runs, once in each of two jax.distributed processes and
once in the test's own process on as many local devices: the results must agree."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.multihost import StepHub
from areal_jax.trainer.prepare import POLICY_KEYS, fetch
from sharding import MeshConfig, make_mesh

MESH = MeshConfig(data=1, fsdp=2, tensor=2)
SPLIT = MeshConfig(data=1, fsdp=2, tensor=1)
"""The trainer's mesh beside an engine (``rollout.local.placement: split``): fsdp over one device
of each process."""


def split_mesh(devices: list[jax.Device] | None = None) -> Mesh:
    """``SPLIT`` over ``devices``; by default each process's first device, as the split placement
    leaves the trainer (``trainer.rollout.local_devices``), the others being the engine's."""
    if devices is None:
        devices = [next(d for d in jax.devices() if d.process_index == p) for p in range(jax.process_count())]
    return make_mesh(SPLIT, devices=devices)


def run(mesh: Mesh, estimator: str = "grpo") -> dict[str, np.ndarray]:
    """Two train batches with a KL reference (the proximal recompute, reference logprobs gathered
    back to the host, advantages, two minibatches each; with ``estimator='gae'`` also the critic's
    values gathered back and its updates): the first minibatch's gradient, every step's
    statistics and the params after, all gathered whole. Over two processes each batch reaches
    process 1 as a run's batches do, its own share only (``_share``)."""
    from tests.trainer.helpers import random_trajectories, tiny_model

    trainer = Trainer(tiny_model(seed=3), AlgoConfig(ppo_n_minibatches=2, kl_coef=0.1, adv_estimator=estimator),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64), lr=1e-2), mesh=mesh)
    assert trainer.dp_groups == 2
    out: dict[str, np.ndarray] = {}
    prepared = trainer.prepare_batch(_share(trainer, random_trajectories(np.random.default_rng(0), 4, 2)), 0)
    first = prepared.minibatches[0]
    grads, _ = trainer.minibatch_grads([m.inputs((*POLICY_KEYS, "proximal_logprobs")) for m in first], 0,
                                       units=[m.loss_units for m in first])
    for path, g in nnx.to_flat_state(fetch(grads)):
        out["grad/" + "/".join(map(str, path))] = np.asarray(g.get_value())
    stats = [trainer.train_prepared(prepared),
             trainer.train_batch(_share(trainer, random_trajectories(np.random.default_rng(1), 4, 2)), 1)]
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


def _share(trainer: Trainer, trajectories: list[Trajectory]) -> list[Trajectory]:
    """The batch as this process trains it. Over two processes, process 0 sends it through the
    run's ``StepHub``, so process 1 holds only the trajectories its devices' rows need, with
    placeholders (NaN logprobs) for the rest, and checks that it received less than the whole
    batch; with one process, the batch as it is."""
    if jax.process_count() == 1:
        return trajectories
    hub = StepHub(trainer.preparer.row_owners)
    if hub.leader:
        hub.announce("train", step=0, version=0, trajectories=trajectories)
        return trajectories
    message = hub.receive()
    got = message["trajectories"]
    own = [i for i, t in enumerate(got) if not np.isnan(t.behavior_logprobs).any()]
    assert 0 < message["own"] == len(own) < len(trajectories), (message["own"], len(trajectories))
    assert message["token_bytes"] == 12 * sum(len(trajectories[i]) for i in own) < message["whole_token_bytes"]
    for i in own:
        np.testing.assert_array_equal(got[i].input_ids, trajectories[i].input_ids)
        np.testing.assert_array_equal(got[i].behavior_logprobs, trajectories[i].behavior_logprobs)
    for t, want in zip(got, trajectories, strict=True):
        np.testing.assert_array_equal(t.loss_mask, want.loss_mask)
        assert (t.reward, t.group_id, t.prompt_len) == (want.reward, want.group_id, want.prompt_len)
    return got
