"""Decoder layers as stacked parameters under a scan: the traced program does not grow with
depth, remat policies keep what they say, and HF tensors map to and from layer slices."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Decoder, ModelConfig, assign_hf_tensors, hf_tensor_specs, iter_hf_tensors, load_pretrained

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _grad_jaxpr_size(layers: int, remat: str = "none") -> int:
    cfg = ModelConfig(num_hidden_layers=layers, remat=remat)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
    return len(jax.make_jaxpr(jax.grad(loss))(state, ids).eqns)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_gradient_program_does_not_grow_with_depth(remat: str) -> None:
    """What XLA compiles is the same program at 2 and 12 layers: one scanned layer body."""
    assert _grad_jaxpr_size(2, remat) == _grad_jaxpr_size(12, remat)


def test_parameters_are_stacked_along_a_layers_axis() -> None:
    model = load_pretrained(FIXTURES / "hf_qwen3")
    q = model.layers.self_attn.q_proj.kernel
    assert q[...].shape == (2, 32, 32)
    assert q.get_metadata()["out_sharding"] == ("layers", "embed", "heads")
    specs = hf_tensor_specs(model)
    assert specs["model.layers.1.self_attn.q_proj.weight"] == (32, 32)
    assert specs["model.layers.0.input_layernorm.weight"] == (32,)
    assert len(specs) == 3 + 2 * 11  # embed, norm, lm_head; 11 tensors per Qwen3 layer


def test_assign_one_layer_of_a_stacked_parameter() -> None:
    model = load_pretrained(FIXTURES / "hf_llama")
    before = np.asarray(model.layers.mlp.up_proj.kernel[...])
    tensors = dict(iter_hf_tensors(model))
    new = tensors["model.layers.1.mlp.up_proj.weight"] + 1.0  # HF layout [out, in]
    assert assign_hf_tensors(model, {"model.layers.1.mlp.up_proj.weight": new}) == ["model.layers.1.mlp.up_proj.weight"]
    after = np.asarray(model.layers.mlp.up_proj.kernel[...])
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], new.T)
    # Every layer at once builds the stacked array directly.
    assign_hf_tensors(model, {f"model.layers.{i}.mlp.up_proj.weight": tensors[f"model.layers.{i}.mlp.up_proj.weight"]
                              for i in range(2)})
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.up_proj.kernel[...]), before)


def test_remat_policy_names() -> None:
    assert ModelConfig(remat=True).remat == "full" and ModelConfig(remat=False).remat == "none"
    with pytest.raises(ValueError, match="remat='some'"):
        ModelConfig(remat="some")
