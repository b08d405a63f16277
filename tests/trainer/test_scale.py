"""Real model shapes through the trainer's own memory plan, lowered and compiled abstractly (no
arrays allocated): Qwen2.5-7B on 8 fake devices and Qwen2.5-1.5B on one fit 80 GiB per device
with the default config, the optimizer state is sharded, and FSDP gathers bfloat16 weights.

The CPU compiles the model's dense block-pair attention (the path it runs); on a GPU the default
``attention_impl: auto`` takes cuDNN's fused kernel, which keeps no score matrices, so these
figures bound the accelerator's from above."""

from __future__ import annotations

import glob
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.models import Decoder
from areal_jax.models.config import ModelConfig
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.memory import GiB, abstract, collective_bytes, device_bytes
from areal_jax.trainer.train_step import POLICY_SCALARS
from sharding import MeshConfig, activate, make_mesh

# config.json shapes (as a bfloat16 checkpoint loads). train_unroll=1 is the GPU and TPU default
# (the CPU's is every layer).
QWEN25_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                 tie_word_embeddings=False, rope_theta=1e6, param_dtype="bfloat16", dtype="bfloat16",
                 train_unroll=1)
QWEN25_1_5B = dict(QWEN25_7B, vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                   num_key_value_heads=2, tie_word_embeddings=True)
# TrainConfig's defaults as a GPU or TPU resolves them (compute_dtype: bfloat16 there, float32 on
# this CPU; micro_batch_tokens: auto is 8192 there, 1024 here), planned for an 80 GiB device.
ACCELERATOR = TrainConfig(compute_dtype="bfloat16", device_memory_gb=80).resolved("gpu")


def abstract_trainer(shape: dict, devices: int, train: TrainConfig = ACCELERATOR) -> Trainer:
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:devices])
    with activate(mesh):
        model = nnx.eval_shape(lambda: Decoder(ModelConfig(**shape), rngs=nnx.Rngs(0)))
    trainer = Trainer(model, AlgoConfig(), train, mesh=mesh)
    assert trainer.abstract
    return trainer


def partitioned_hlo(trainer: Trainer) -> str:
    """The gradient step's HLO right after SPMD partitioning: the collectives as partitioned,
    before the CPU backend's own passes (which widen bfloat16 dots, and their gathers, to float32).
    Compiled under a module name of its own, and not kept: a compilation cache hit would dump nothing."""
    learner = trainer.policy

    def step(*args: Any) -> Any:
        return learner.grad_fn.__wrapped__(*args)  # the step's own function, jitted again here

    step.__name__ = f"grad_step_{uuid.uuid4().hex}"
    ps, ds, rep = learner.shardings, learner.data_sharding, learner.replicated
    fn = jax.jit(step, in_shardings=(ps, ps, ds, rep), out_shardings=(ps, rep), donate_argnums=(1,))
    p = abstract(learner.params)
    with activate(trainer.mesh):
        lowered = fn.lower(p, p, trainer.largest_micro_batch(), POLICY_SCALARS)
    dump = tempfile.mkdtemp()
    keep = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        lowered.compile({"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", keep)
    (path,) = glob.glob(f"{dump}/*{step.__name__}*after_spmd-partitioning*.txt")
    text = Path(path).read_text()
    shutil.rmtree(dump, ignore_errors=True)
    return text


def weight_gathers(hlo: str) -> dict[str, int]:
    """Bytes of the forward pass's floating-point all-gathers by dtype (the backward pass's gathers
    of gradient pieces and the integer ones of the batch aside)."""
    lines = [line for line in hlo.splitlines() if "all-gather(" in line and "transpose(" not in line]
    return {k: v for k, v in collective_bytes("\n".join(lines)).items() if k in ("bf16", "f32")}


@pytest.mark.slow
def test_qwen25_7b_fits_8_devices_by_default() -> None:
    trainer = abstract_trainer(QWEN25_7B, 8)
    plan = trainer.memory
    assert plan is not None and plan.chosen.peak_bytes < 80 * GiB, plan.describe()
    assert trainer.policy.remat == plan.remat != "none"  # nothing left is 0.5 TiB of activations
    assert [m.remat for m in plan.tried] == ["none", "dots", "full"][:len(plan.tried)]
    assert all(m.peak_bytes > 80 * GiB for m in plan.tried[:-1])
    # Params, gradients and Adam's two moments: 16 bytes per parameter, an eighth on each device
    # (norms and biases, replicated, are a rounding error).
    n = ModelConfig(**QWEN25_7B).num_params()
    state = 2 * device_bytes(trainer.policy.params) + device_bytes(trainer.policy.opt_state)
    np.testing.assert_allclose(state, 16 * n / 8, rtol=0.005)
    assert plan.chosen.state_bytes == device_bytes(trainer.policy.params) + device_bytes(trainer.policy.opt_state)


@pytest.mark.slow
def test_qwen25_7b_gathers_bfloat16_layers_and_the_head_once() -> None:
    """FSDP gathers the compute-dtype copy of each layer's weights (cast on its shard), half the
    bytes of the float32 masters, and the head once a micro-batch, before the chunked logprobs'
    loop: whole and in float32, so that its gradient sums over the chunks in float32, scattered
    into its shards each chunk (``Decoder.head_weight``). Gathered inside the loop instead it
    was three gathers a chunk (bfloat16 forward, bfloat16 recompute, float32 for the hidden
    states' gradient). Read off the partitioned HLO: XLA:CPU's later passes widen bfloat16 dots
    to float32 and their gathers with them, which an accelerator does not."""
    train = TrainConfig(compute_dtype="bfloat16", remat="full")  # no plan: one compile
    hlo = partitioned_hlo(abstract_trainer(QWEN25_7B, 8, train))
    vocab, hidden = QWEN25_7B["vocab_size"], QWEN25_7B["hidden_size"]
    head = [line for line in hlo.splitlines() if "all-gather(" in line and str(vocab) in line.split("all-gather(")[0]]
    assert len(head) == 1 and "/while/" not in head[0], head  # once, outside every loop
    assert collective_bytes(head[0]) == {"f32": 4 * vocab * hidden}, head
    layers = weight_gathers("\n".join(line for line in hlo.splitlines() if line not in head))
    assert set(layers) == {"bf16"}, layers
    # Every weight matrix of a layer (in the scan's body, written once), gathered whole from its
    # eighths: 2 bytes an element.
    layer = 3584 * (28 * 128 + 2 * 4 * 128) + 28 * 128 * 3584 + 3 * 3584 * 18944
    assert layers["bf16"] >= 2 * layer, layers
    # The head's gradient is summed into its shards in the loop, never held whole outside it.
    grads = [line for line in hlo.splitlines() if "all-gather(" in line and "transpose(" in line
             and str(vocab) in line.split("all-gather(")[0]]
    assert grads == [], grads


@pytest.mark.slow
def test_qwen25_15b_fits_one_device() -> None:
    trainer = abstract_trainer(QWEN25_1_5B, 1)
    plan = trainer.memory
    assert plan is not None and plan.chosen.peak_bytes < 80 * GiB, plan.describe()
    n = ModelConfig(**QWEN25_1_5B).num_params()
    np.testing.assert_allclose(2 * device_bytes(trainer.policy.params) + device_bytes(trainer.policy.opt_state),
                               16 * n, rtol=1e-6)
