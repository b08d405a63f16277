"""Decoder layers as stacked parameters under a scan: the traced program does not grow with
depth, in training and in KV-cache decoding (whose scan carries the stacked cache and updates it
in place), remat policies keep what they say, and HF tensors map to and from layer slices."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.steps import SlotState, compile_steps
from areal_jax.models import Decoder, ModelConfig, assign_hf_tensors, hf_tensor_specs, iter_hf_tensors, load_pretrained
from tests.models.jaxprs import dot_generals

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _grad_jaxpr(layers: int, remat: str = "none") -> jax.extend.core.ClosedJaxpr:
    cfg = ModelConfig(num_hidden_layers=layers, remat=remat)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    ids = jax.ShapeDtypeStruct((1, 32), jnp.int32)
    loss = lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2)
    return jax.make_jaxpr(jax.grad(loss))(state, ids)


def _grad_jaxpr_size(layers: int, remat: str = "none") -> int:
    return len(_grad_jaxpr(layers, remat).eqns)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_gradient_program_does_not_grow_with_depth(remat: str) -> None:
    """What XLA compiles is the same program at 2 and 12 layers: one scanned layer body."""
    assert _grad_jaxpr_size(2, remat) == _grad_jaxpr_size(12, remat)


def test_remat_policies_recompute_what_they_say() -> None:
    """The gradient program's matmuls: ``none`` recomputes none, ``dots`` only attention's
    (batched: not saveable under its policy), ``full`` every one of the layer's. A policy that
    were silently ignored would tie with another. Measured: 30, 32 and 38."""
    counts = {remat: len(dot_generals(_grad_jaxpr(2, remat).jaxpr)) for remat in ("none", "dots", "full")}
    assert counts["none"] < counts["dots"] < counts["full"], counts
    # dots recomputes exactly attention's two batched einsums (scores, weighted values).
    assert counts["dots"] - counts["none"] == 2, counts


def _decode_jaxpr_size(layers: int, tokens: int, slots: bool) -> int:
    cfg = ModelConfig(num_hidden_layers=layers)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)).init_cache(4, 64))

    def step(state, cache, ids):
        rows = jnp.arange(2) if slots else None
        return nnx.merge(graphdef, state).decode(ids, jnp.zeros(ids.shape, jnp.int32), cache, kv_len=32, slots=rows)

    ids = jax.ShapeDtypeStruct((2 if slots else 4, tokens), jnp.int32)
    return len(jax.make_jaxpr(step)(state, cache, ids).eqns)


@pytest.mark.parametrize(("tokens", "slots"), [(1, False), (8, True)], ids=["decode", "prefill_into_slots"])
def test_decode_program_does_not_grow_with_depth(tokens: int, slots: bool) -> None:
    """The KV-cache path (a decode step, a prefill into chosen slots) is one scanned layer too."""
    assert _decode_jaxpr_size(2, tokens, slots) == _decode_jaxpr_size(12, tokens, slots)


def test_decode_step_updates_the_stacked_cache_in_place() -> None:
    """The engine's decode chunk (8 steps through 4 layers) neither copies the donated cache nor
    rebuilds it per layer: its output aliases the input and its temporary memory is a small
    fraction of the cache's size."""
    cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    cache = jax.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)).init_cache(8, 1024))
    cache_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))  # 16 MiB
    slot_state = jax.eval_shape(lambda: SlotState.empty(8))
    active = jax.ShapeDtypeStruct((8,), jnp.bool_)
    compiled = compile_steps(graphdef, 2).decode.lower(
        state, cache, slot_state, active, jax.ShapeDtypeStruct((), jnp.bool_), kv_len=512, num_steps=8).compile()
    memory = compiled.memory_analysis()
    assert memory.alias_size_in_bytes >= cache_bytes
    # Measured 2.5 MiB; carrying the cache as the scan's per-layer input and output instead: 21 MiB.
    assert memory.temp_size_in_bytes < cache_bytes / 2, (memory.temp_size_in_bytes, cache_bytes)


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


def _loss_and_grad(unroll: int | None, ids: jax.Array) -> tuple[str, jax.Array, nnx.State]:
    model = Decoder(ModelConfig(num_hidden_layers=3, train_unroll=unroll), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loss = lambda s: jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, s)(ids)) ** 2)
    fn = jax.jit(jax.value_and_grad(loss))
    return fn.lower(state).as_text(), *fn(state)


def test_train_unroll_changes_only_how_the_layers_compile() -> None:
    """``train_unroll``: the packed path's scan over layers runs that many layers an iteration
    (on CPU all of them by default, the faster program there). 1, 2 (with a remainder) and all 3
    give the same loss and gradient; the lowered program loops over layers only when it does not
    unroll them all."""
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, (2, 9)), jnp.int32)
    runs = {unroll: _loss_and_grad(unroll, ids) for unroll in (1, 2, 3, None)}
    for unroll in (2, 3, None):
        np.testing.assert_allclose(runs[unroll][1], runs[1][1], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(runs[unroll][2]), jax.tree.leaves(runs[1][2]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    loops = {unroll: "stablehlo.while" in text for unroll, (text, _, _) in runs.items()}
    assert loops == {1: True, 2: True, 3: False, None: jax.default_backend() != "cpu"}, loops
    with pytest.raises(ValueError, match="train_unroll=0"):
        ModelConfig(train_unroll=0)
