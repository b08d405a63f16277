"""The trainer's memory plan (``trainer/memory.py``): XLA's figures for each remat policy, the
cheapest policy that fits the device chosen before any array is allocated, a clear error naming
the knobs when none fits, nothing compiled where no memory limit is known; and the reference
model kept in the compute dtype."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.models import Decoder, ModelConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.memory import GiB, MemoryPlanError, device_capacity, step_memory
from areal_jax.trainer.train_step import POLICY_SCALARS
from sharding import MeshConfig, activate, make_mesh
from tests.trainer.helpers import random_trajectories, tiny_model

SHAPE = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, train_unroll=1)
TRAIN = dict(micro_batch_tokens=512, length_buckets=(512,), attention_block=0)


def abstract_trainer(**train: object) -> Trainer:
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    with activate(mesh):
        model = nnx.eval_shape(lambda: Decoder(SHAPE, rngs=nnx.Rngs(0)))
    return Trainer(model, AlgoConfig(), TrainConfig(**{**TRAIN, **train}), mesh=mesh)


@pytest.fixture(scope="module")
def peaks() -> dict[str, int]:
    """Each policy's planned peak, measured directly."""
    trainer = abstract_trainer(remat="none")
    out = {}
    for policy in ("none", "dots", "full"):
        trainer.policy.use_remat(policy)
        out[policy] = step_memory(trainer.policy, trainer.largest_micro_batch(), POLICY_SCALARS).peak_bytes
    return out


def test_policies_trade_memory_in_order(peaks: dict[str, int]) -> None:
    assert peaks["none"] > peaks["dots"] > peaks["full"], peaks


def test_plan_picks_the_cheapest_policy_that_fits(peaks: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    room = (peaks["dots"] + peaks["none"]) / 2 / GiB
    with caplog.at_level(logging.INFO, logger="areal_jax.trainer.memory"):
        trainer = abstract_trainer(device_memory_gb=room)
    plan = trainer.memory
    assert plan is not None and plan.remat == trainer.policy.remat == "dots"
    assert [m.remat for m in plan.tried] == ["none", "dots"]
    assert plan.chosen.peak_bytes == peaks["dots"]
    assert "memory plan: remat=dots" in caplog.text and "none needs" in caplog.text
    metrics = plan.metrics()
    assert metrics["remat"] == "dots" and metrics["memory_peak_gib"] == pytest.approx(peaks["dots"] / GiB)
    # Room for everything: no remat.
    assert abstract_trainer(device_memory_gb=2 * peaks["none"] / GiB).policy.remat == "none"


def test_no_policy_fits_names_the_knobs(peaks: dict[str, int]) -> None:
    with pytest.raises(MemoryPlanError, match="micro_batch_tokens.*mesh.fsdp") as e:
        abstract_trainer(device_memory_gb=peaks["full"] * 0.99 / GiB)
    assert "remat=full" in str(e.value) and "train.micro_batch_tokens=512" in str(e.value)
    # Less than the params and optimizer state themselves: shard them.
    with pytest.raises(MemoryPlanError, match=r"params and optimizer state alone .* \(raise mesh.fsdp\)"):
        abstract_trainer(device_memory_gb=1e-4)


def test_a_named_policy_is_checked_not_replaced(peaks: dict[str, int]) -> None:
    room = (peaks["dots"] + peaks["none"]) / 2 / GiB
    with pytest.raises(MemoryPlanError, match="remat=none.*train.remat: full or auto"):
        abstract_trainer(remat="none", device_memory_gb=room)
    assert abstract_trainer(remat="full", device_memory_gb=room).policy.remat == "full"


def test_no_plan_without_a_memory_limit() -> None:
    """On a CPU with no ``device_memory_gb``: nothing compiled, ``auto`` means no remat."""
    assert device_capacity(None, jax.devices()[:1]) == (None, "no device memory limit known")
    trainer = Trainer(tiny_model(), AlgoConfig(), TrainConfig(micro_batch_tokens=64, length_buckets=(64,)))
    assert trainer.memory is None and trainer.policy.remat == "none"


def test_device_capacity_from_reported_limit() -> None:
    class Reporting:  # what a GPU or TPU device answers (this CPU reports nothing)
        def __init__(self, used: int) -> None:
            self.used = used

        def memory_stats(self) -> dict[str, int]:
            return {"bytes_limit": 10 * GiB, "bytes_in_use": self.used}

    capacity, source = device_capacity(None, [Reporting(0), Reporting(0)])
    assert capacity == 9 * GiB and source == "90% of the 10.0 GiB the device reports"
    # What is already there (the loaded model, an engine's pages) is not the step's to plan with.
    capacity, source = device_capacity(None, [Reporting(GiB // 2), Reporting(GiB)])
    assert capacity == 8 * GiB and source.endswith("less 1.0 GiB already in use")
    assert device_capacity(2.5, [Reporting(GiB)]) == (int(2.5 * GiB), "train.device_memory_gb=2.5")


def test_planned_trainer_trains() -> None:
    """A real model planned with a limit trains on the learner rebuilt with the chosen policy."""
    trajs = random_trajectories(np.random.default_rng(0), 2, 4)
    cfg = dict(micro_batch_tokens=64, length_buckets=(64,), lr=1e-3)
    planned = Trainer(tiny_model(), AlgoConfig(), TrainConfig(device_memory_gb=4, **cfg))
    assert planned.memory is not None and planned.policy.remat == "none" and not planned.abstract
    plain = Trainer(tiny_model(), AlgoConfig(), TrainConfig(**cfg))
    a, b = planned.train_batch(trajs, 0), plain.train_batch(trajs, 0)
    for key in ("loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-6), key


def test_reference_model_in_compute_dtype() -> None:
    """With bfloat16 compute the frozen reference holds bfloat16 weights (norms stay float32) and
    scores exactly what the float32 policy it was copied from scores."""
    trajs = random_trajectories(np.random.default_rng(1), 2, 4)
    trainer = Trainer(tiny_model(), AlgoConfig(kl_coef=0.1), TrainConfig(
        compute_dtype="bfloat16", micro_batch_tokens=64, length_buckets=(64,)))
    dtypes = {jax.tree_util.keystr(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(trainer.ref_params)}
    assert all(d == (jnp.float32 if "norm" in k else jnp.bfloat16) for k, d in dtypes.items()), dtypes
    policy = np.concatenate(trainer.compute_logprobs(trajs))
    reference = np.concatenate(trainer.compute_logprobs(trajs, reference=True))
    np.testing.assert_allclose(reference, policy, rtol=0, atol=1e-6)


def test_config_keys() -> None:
    from areal_jax.config import ConfigError, from_dict
    from areal_jax.trainer.run_config import RunConfig

    cfg = from_dict(RunConfig, {"train": {"device_memory_gb": 80, "remat": "auto"}})
    assert cfg.train.device_memory_gb == 80.0 and cfg.train.remat == "auto"
    assert TrainConfig().remat == "auto" and TrainConfig(remat=True).remat == "full"
    with pytest.raises(ConfigError, match="remat='some'; choose auto, none, dots or full"):
        from_dict(RunConfig, {"train": {"remat": "some"}})
    with pytest.raises(ConfigError, match="device_memory_gb must be positive"):
        from_dict(RunConfig, {"train": {"device_memory_gb": 0}})
