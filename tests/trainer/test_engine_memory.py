"""The in-process engine beside the trainer in the memory plan (``rollout.backend: local``,
placement ``shared``): its KV cache (the slot cache's slots x context, the paged pool's
``--max-total-tokens`` or what ``--mem-fraction-static`` leaves) and its weights are added to
the step's peak, the plan takes more remat to make room for them, and a plan that cannot fit
names the engine's flags. Both are counted at the engine's own sharding (on several processes
a host's engine is sharded over that host's devices only). Abstract (no arrays allocated), at a
tiny shape and at Qwen2.5-7B's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.inference.config import EngineConfig
from areal_jax.inference.pool_size import kv_bytes_per_token
from areal_jax.models import Decoder
from areal_jax.models.config import ModelConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.memory import (
    GiB,
    MemoryPlanError,
    device_bytes,
    engine_memory,
    engine_weight_bytes,
    step_memory,
)
from areal_jax.trainer.train_step import POLICY_SCALARS
from sharding import MeshConfig, activate, make_mesh
from tests.trainer.test_memory_plan import SHAPE, TRAIN
from tests.trainer.test_scale import QWEN25_7B


def _trainer(engine: EngineConfig | None = None, devices: int = 1, engine_mesh: object = None,
             **train: object) -> Trainer:
    mesh = make_mesh(MeshConfig(fsdp=-1), devices=jax.devices()[:devices])
    with activate(mesh):
        model = nnx.eval_shape(lambda: Decoder(SHAPE, rngs=nnx.Rngs(0)))
    return Trainer(model, AlgoConfig(), TrainConfig(**{**TRAIN, **train}), mesh=mesh, engine=engine,
                   engine_mesh=engine_mesh)


@pytest.fixture(scope="module")
def figures() -> dict[str, int]:
    """Each policy's peak and the state, measured directly, and the tiny model's weights."""
    trainer = _trainer(remat="none")
    out = {"params": device_bytes(trainer.policy.params)}
    for policy in ("none", "dots"):
        trainer.policy.use_remat(policy)
        m = step_memory(trainer.policy, trainer.largest_micro_batch(), POLICY_SCALARS)
        out[policy], out["state"] = m.peak_bytes, m.state_bytes
    return out


# One token's keys and values in the tiny model's float32 cache: 2 layers x 2 KV heads x 32 dims x 2 x 4 bytes.
TINY_TOKEN = 2 * 2 * 2 * 32 * 4


def test_the_slot_cache_and_the_weights_push_the_plan_to_more_remat(figures: dict[str, int]) -> None:
    slots = EngineConfig(kv_cache="slots", num_slots=16, max_seq_len=1024)
    engine = 16 * 1024 * TINY_TOKEN + figures["params"]  # a float32 engine: its weights are the params' size
    # Room for the step without remat, but not for it and the engine: dots.
    room = figures["none"]
    assert figures["none"] + engine > room >= figures["dots"] + engine
    trainer = _trainer(slots, device_memory_gb=room / GiB)
    plan = trainer.memory
    assert plan is not None and plan.remat == "dots" and plan.engine_bytes == engine
    assert "engine beside it: " in plan.describe() and "slot cache, 16,384 tokens" in plan.describe()
    assert plan.metrics()["memory_engine_gib"] == pytest.approx(engine / GiB)
    # Without the engine the same room takes no remat.
    assert _trainer(device_memory_gb=room / GiB).memory.remat == "none"


def test_a_pool_too_large_names_the_engine_flags(figures: dict[str, int]) -> None:
    pool = EngineConfig(kv_cache="paged", num_slots=64, max_seq_len=4096, max_total_tokens=200_000)
    room = figures["none"] * 2 / GiB  # fits the step alone, not 200,000 tokens x 1 KiB beside it
    with pytest.raises(MemoryPlanError) as e:
        _trainer(pool, device_memory_gb=room)
    text = str(e.value)
    assert "the engine beside the trainer takes" in text and "page pool (--max-total-tokens)" in text
    assert "rollout.server_args --max-total-tokens or --mem-fraction-static" in text
    assert "rollout.local.placement: split" in text and "train.micro_batch_tokens" in text
    # A pool of 1,024 tokens fits beside the unrematerialised step.
    small = EngineConfig(kv_cache="paged", num_slots=64, max_seq_len=4096, max_total_tokens=1024)
    assert _trainer(small, device_memory_gb=room).memory.remat == "none"


def test_mem_fraction_takes_the_step_s_room(figures: dict[str, int]) -> None:
    """Sized from memory, the pool takes ``--mem-fraction-static`` of the device less what is
    there first (the trainer's state, the engine's weights): SGLang's rule, and with the default
    0.85 the step's scratch no longer fits."""
    device = 2 * figures["none"]  # twice the unrematerialised step: room for it alone
    scratch = figures["none"] - figures["state"]
    assert 0.15 * device < scratch <= 0.5 * device
    fraction = EngineConfig(kv_cache="paged", num_slots=64, max_seq_len=4096, mem_fraction_static=0.85)
    with pytest.raises(MemoryPlanError, match="--mem-fraction-static 0.85"):
        _trainer(fraction, remat="none", device_memory_gb=device / GiB)
    low = EngineConfig(kv_cache="paged", num_slots=64, max_seq_len=4096, mem_fraction_static=0.5)
    plan = _trainer(low, remat="none", device_memory_gb=device / GiB).memory
    state = plan.chosen.state_bytes
    want = (int(0.5 * device) - state - figures["params"]) // TINY_TOKEN * TINY_TOKEN
    assert plan.engine.cache_bytes(state) == want > 0
    assert plan.chosen.peak_bytes + want + figures["params"] <= device


@pytest.mark.parametrize("tensor", [1, 4, 8])
def test_qwen25_7b_engine_on_8_devices(tensor: int) -> None:
    """Qwen2.5-7B's cache per device on an 8-device mesh, against the engine's own count of a
    token's bytes (``kv_bytes_per_token``, all heads and their replicas, over the tensor axis):
    4 KV heads x 128 dims x 28 layers x K and V x 2 bytes = 57,344 bytes a token; over 4 or 8
    tensor shards each device holds one head (8 shards replicate each head twice)."""
    cfg = ModelConfig(**QWEN25_7B)
    mesh = make_mesh(MeshConfig(fsdp=-1, tensor=tensor), devices=jax.devices()[:8])
    with activate(mesh):
        model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
        engine_token = kv_bytes_per_token(model)
    n = cfg.num_params()
    slots = engine_memory(cfg, EngineConfig(kv_cache="slots", num_slots=256, max_seq_len=4096), mesh)
    assert slots.token_bytes == engine_token // tensor == 57_344 // min(tensor, 4)
    ways = 8 // tensor
    assert slots.tokens == 256 * 4096 // ways
    # bfloat16 weights, about an eighth on each device (the norms, and the biases and KV
    # kernels where the tensor split is wider than the 4 KV heads, are held whole or twice)
    assert 2 * (n // 8) < slots.weight_bytes < 2 * (n // 8) * 1.1
    if tensor == 1:  # 256 slots of 4,096 tokens over 8 devices: 7 GiB each, and 1.8 GiB of weights
        assert slots.bytes_beside(0) / GiB == pytest.approx(7.0 + 2 * n / 8 / GiB, rel=1e-3)
    # The default pool on an 80 GiB device beside 7B's sharded state (16 bytes a parameter / 8).
    pool = engine_memory(cfg, EngineConfig(kv_cache="paged", num_slots=256, max_seq_len=32768), mesh,
                         device_limit=80 * GiB)
    state = 16 * n // 8
    cache = pool.cache_bytes(state)
    assert cache == (int(0.85 * 80 * GiB) - state - pool.weight_bytes) // pool.token_bytes * pool.token_bytes
    assert 80 * GiB - state - pool.weight_bytes - cache == pytest.approx(0.15 * 80 * GiB, abs=pool.token_bytes)
    np.testing.assert_allclose(cache / GiB, 0.85 * 80 - state / GiB - pool.weight_bytes / GiB, atol=1e-3)


def _qwen25_7b_shard_elements(fsdp: int) -> int:
    """Qwen2.5-7B's parameters on one device of a mesh of ``fsdp`` devices (tensor 1), counted by
    hand from its shapes: every kernel and the embeddings split over fsdp along the hidden
    size, the q/k/v biases and the norms whole."""
    h, i, layers, d, heads, kv, vocab = 3584, 18944, 28, 128, 28, 4, 152064
    kernels = layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * i) + 2 * vocab * h
    whole = layers * (heads * d + 2 * kv * d + 2 * h) + h
    return kernels // fsdp + whole


def test_a_pod_engine_s_weights_are_counted_at_its_own_sharding() -> None:
    """On a pod each host's engine is sharded over that host's devices only (``rollout.local``
    shared, several processes: ``fsdp`` over the host's devices, projections fused), while the
    trainer's mesh spans every host: 8 devices standing in for 2 hosts of 4, the engine on one
    host's 4 holds a quarter of Qwen2.5-7B's weights on each device, against an eighth of the
    trainer's. The KV slots split over the host's 4 devices."""
    cfg = ModelConfig(**QWEN25_7B)
    trainer_mesh = make_mesh(MeshConfig(fsdp=-1), devices=jax.devices()[:8])
    host_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), devices=jax.devices()[:4])
    slots = engine_memory(cfg, EngineConfig(kv_cache="slots", num_slots=256, max_seq_len=4096), host_mesh,
                          fused=True)
    assert slots.weight_bytes == 2 * _qwen25_7b_shard_elements(4)  # bfloat16
    assert engine_weight_bytes(cfg, trainer_mesh) == 2 * _qwen25_7b_shard_elements(8)  # the trainer's shard
    assert slots.weight_bytes / engine_weight_bytes(cfg, trainer_mesh) == pytest.approx(2, rel=1e-3)
    assert slots.weight_bytes / GiB == pytest.approx(3.55, abs=0.01)
    assert slots.tokens == 256 * 4096 // 4
    # The engine's --dtype decides the bytes: float32 doubles them.
    assert engine_memory(cfg, EngineConfig(kv_cache="slots", num_slots=256, max_seq_len=4096), host_mesh,
                         dtype="float32", fused=True).weight_bytes == 2 * slots.weight_bytes


def test_the_trainer_plans_the_engine_on_its_own_mesh(figures: dict[str, int]) -> None:
    """The trainer on 2 devices, its engine on 1 (a host's share): the plan counts the engine's
    whole weights on that device, not the trainer's half."""
    slots = EngineConfig(kv_cache="slots", num_slots=16, max_seq_len=1024)
    one = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    plan = _trainer(slots, devices=2, engine_mesh=one, device_memory_gb=64).memory
    assert plan.engine.weight_bytes == figures["params"] == device_bytes(_trainer().policy.params)
    assert plan.engine.tokens == 16 * 1024
    shared = _trainer(slots, devices=2, device_memory_gb=64).memory  # on the trainer's own 2 devices
    assert shared.engine.weight_bytes < figures["params"] and shared.engine.tokens == 16 * 1024 // 2


def test_a_run_plans_the_shared_local_engine_from_its_server_args() -> None:
    """``rl.train`` passes the engine of ``rollout.server_args`` to the trainer's plan with the
    shared placement only (a split engine has devices of its own, servers have their hosts)."""
    from areal_jax.trainer.rollout import engine_beside_trainer
    from areal_jax.trainer.run_config import load_run_config
    from tests.trainer.test_multihost_run import DEMO

    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    args = "rollout.server_args=[--max-running-requests, '16', --context-length, '512', --kv-cache, paged, " \
           "--max-total-tokens, '4096', --dtype, bfloat16]"
    got = engine_beside_trainer(load_run_config(DEMO, ["rollout.backend=local", args]), mesh)
    engine = got["engine"]
    assert (engine.kv_cache, engine.num_slots, engine.max_seq_len, engine.max_total_tokens) == ("paged", 16, 512, 4096)
    assert got["engine_dtype"] == "bfloat16" and got["engine_mesh"] is mesh and got["engine_fused"] is False
    assert engine_beside_trainer(load_run_config(DEMO, ["rollout.backend=local", "rollout.local.placement=split"]),
                                 mesh) == {}
    assert engine_beside_trainer(load_run_config(DEMO, ["rollout.backend=embedded"]), mesh) == {}
