"""A step on a mesh of 8 fake devices equals the single-device step: loss, gradient norm and the
updated parameters, although each DP group packs its own rows and the micro-batches differ."""

import jax
import numpy as np
import pytest

from areal_jax.algo import AlgoConfig
from areal_jax.trainer import TrainConfig, Trainer
from sharding import MeshConfig, make_mesh
from tests.trainer.helpers import random_trajectories, tiny_model

ALGO = AlgoConfig(ppo_n_minibatches=2)
TRAIN = TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2, grad_clip=0.5)


@pytest.fixture(scope="module")
def single_device_result() -> tuple[dict, list]:
    trajs = random_trajectories(np.random.default_rng(0), 4, 4)
    trainer = Trainer(tiny_model(seed=2), ALGO, TRAIN)
    stats = trainer.train_batch(trajs, 0)
    return trajs, stats, jax.tree.leaves(jax.device_get(trainer.policy.params))


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(data=2, fsdp=2, tensor=2), MeshConfig(data=1, fsdp=8, tensor=1)],
                         ids=["data2_fsdp2_tensor2", "fsdp8"])
def test_sharded_step_equals_single_device(single_device_result: tuple, mesh_cfg: MeshConfig) -> None:
    trajs, ref_stats, ref_params = single_device_result
    trainer = Trainer(tiny_model(seed=2), ALGO, TRAIN, mesh=make_mesh(mesh_cfg))
    assert trainer.dp_groups == mesh_cfg.data * mesh_cfg.fsdp
    stats = trainer.train_batch(trajs, 0)
    for key in ("loss", "grad_norm", "entropy", "clip_fraction", "behavior_imp_weight_mean"):
        np.testing.assert_allclose(stats[key], ref_stats[key], rtol=2e-4, atol=1e-6, err_msg=key)
    params = jax.tree.leaves(jax.device_get(trainer.policy.params))
    moved = max(np.abs(p - q).max() for p, q in zip(params, jax.tree.leaves(tiny_model(seed=2)), strict=True))
    assert moved > 1e-3
    assert_adam_updates_agree(params, ref_params, steps=ALGO.ppo_n_minibatches)
    _assert_sharded_not_copied(trainer, mesh_cfg)


def assert_adam_updates_agree(params: list, ref_params: list, steps: int, lr: float = TRAIN.lr) -> None:
    """Parameters after ``steps`` Adam steps on a mesh against one device's. The gradients agree
    to about 2e-6 (tests/sharding/test_sharded_model.py), but Adam divides each gradient by its own
    magnitude: an element's update moves by about ``lr * 2e-6 / |g|``, which is the whole step
    (``lr``) where ``|g|`` is near the noise and 1e-6 where ``|g|`` is 0.02. So the tolerance is the
    arithmetic's, in two parts: every element is within the most two sets of Adam steps can differ
    (each step moves an element by at most ``lr * 1.0015`` for betas 0.9/0.999 in the first two
    steps, weight decay aside), and all but one element in a thousand (those with a gradient within
    about 100 times the noise) agree to 1e-4, a hundredth of a step. A step that went wrong (a
    gradient not reduced across devices, rows trained twice) moves most elements by a good part of
    a step and fails the second part; a NaN or a garbage update fails the first. Measured: the
    largest difference 4.1e-5 and 2.7e-5 (policy, the two meshes) and 9.4e-5 (critic) under this
    suite's flags, 5.9e-5 (critic) at XLA's default level; one loaded suite run had 1 element of a
    16,384-element critic leaf at 1.4e-4, which failed the former fixed 1e-4."""
    diff = np.concatenate([np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).ravel()
                           for p, q in zip(params, ref_params, strict=True)])
    bound = 2 * steps * lr * 1.0015 + 1e-6
    assert np.isfinite(diff).all() and diff.max() <= bound, (diff.max(), bound)
    off = int((diff > 1e-4).sum())
    assert off <= diff.size // 1000, f"{off} of {diff.size} elements differ by more than 1e-4 (max {diff.max():.2e})"


def _assert_sharded_not_copied(trainer: Trainer, mesh_cfg: MeshConfig) -> None:
    """Every optimizer-state leaf is placed exactly like the parameter it belongs to, and a device
    holds a slice of the large matrices, not a copy: on fsdp 8 its bytes of params plus Adam's
    moments are about an eighth of the total (small replicated leaves such as norms aside)."""
    params = dict(jax.tree_util.tree_leaves_with_path(trainer.policy.params))
    keystr = jax.tree_util.keystr
    by_path = {keystr(p): x for p, x in params.items()}
    matched = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.policy.opt_state):
        hits = [k for k in by_path if keystr(path).endswith(k) and by_path[k].shape == leaf.shape]
        if hits:
            param = by_path[max(hits, key=len)]
            assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), keystr(path)
            matched += 1
    assert matched == 2 * len(by_path)  # Adam's mu and nu for every parameter
    leaves = [*params.values(), *jax.tree.leaves(trainer.policy.opt_state)]
    total = sum(x.nbytes for x in leaves)
    device = jax.devices()[0]
    on_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    if mesh_cfg.fsdp == 8:
        assert on_device / total < 0.2, on_device / total
    else:  # data 2 x fsdp 2 x tensor 2: the matrices are split four ways
        assert on_device / total < 0.4, on_device / total


def test_sharded_critic_step_equals_single_device() -> None:
    """PPO with a critic on 8 FSDP devices: the critic's value head is sharded along ``embed``
    and its step (values, GAE, value loss, update) equals the single-device one."""
    algo = AlgoConfig(adv_estimator="gae", gae_lambda=0.95, adv_norm=True, ppo_n_minibatches=2)
    trajs = random_trajectories(np.random.default_rng(0), 4, 4)
    single = Trainer(tiny_model(seed=2), algo, TRAIN)
    ref = single.train_batch(trajs, 0)
    trainer = Trainer(tiny_model(seed=2), algo, TRAIN, mesh=make_mesh(MeshConfig(data=1, fsdp=8, tensor=1)))
    stats = trainer.train_batch(trajs, 0)
    assert ref["value_clip_fraction"] > 0  # the second minibatch's critic has moved off the old values
    for key in ("value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm", "loss"):
        np.testing.assert_allclose(stats[key], ref[key], rtol=2e-4, atol=1e-6, err_msg=key)
    assert_adam_updates_agree(jax.tree.leaves(jax.device_get(trainer.critic_learner.params)),
                              jax.tree.leaves(jax.device_get(single.critic_learner.params)),
                              steps=algo.ppo_n_minibatches)
