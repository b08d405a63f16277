"""The decoder on 8 fake CPU devices: forward and gradient equal the single-device ones, and the
parameters are really sharded as the logical rules say."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from areal_jax.models import load_pretrained, logprobs_from_logits
from sharding import MeshConfig, activate, logical_to_sharding, logical_to_spec, make_mesh

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2), (1, 2, 4)]


def _loss_and_grad(model, ids, mesh=None):
    graphdef, state = nnx.split(model)

    def loss_fn(state, ids):
        m = nnx.merge(graphdef, state)
        lp = logprobs_from_logits(m(ids)[:, :-1], ids[:, 1:])
        return -jnp.mean(lp)

    with activate(mesh):
        return jax.jit(jax.value_and_grad(loss_fn))(state, ids)


@pytest.fixture(scope="module")
def reference():
    model = load_pretrained(FIXTURES / "hf_qwen3")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (8, 16)), jnp.int32)
    loss, grads = _loss_and_grad(model, ids)
    return ids, np.asarray(model(ids)), loss, grads


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_sharded_forward_and_grad_match_single_device(shape, reference) -> None:
    ids, ref_logits, ref_loss, ref_grads = reference
    mesh = make_mesh(MeshConfig(*shape))
    model = load_pretrained(FIXTURES / "hf_qwen3", mesh=mesh)
    ids_sharded = jax.device_put(ids, logical_to_sharding(("batch", "length"), mesh))
    with activate(mesh):
        logits = jax.jit(lambda m, x: m(x))(model, ids_sharded)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5)
    loss, grads = _loss_and_grad(model, ids_sharded, mesh)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for (path, g), (_, g_ref) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g.get_value()), np.asarray(g_ref.get_value()), atol=2e-6,
                                   err_msg=str(path))


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_parameters_are_sharded_as_the_rules_say(shape) -> None:
    mesh = make_mesh(MeshConfig(*shape))
    model = load_pretrained(FIXTURES / "hf_qwen3", mesh=mesh)
    sizes = dict(mesh.shape)
    checked = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        arr = var.get_value()
        names = var.get_metadata()["out_sharding"]
        spec = logical_to_spec(names)
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), path
        # Each device holds only its block: the global shape divided by the mesh sizes on each dim.
        expected = tuple(
            dim // math.prod(sizes[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            for dim, axes in zip(arr.shape, tuple(spec) + (None,) * (arr.ndim - len(spec)), strict=True)
        )
        assert {s.data.shape for s in arr.addressable_shards} == {expected}, path
        checked += 1
    assert checked >= 14  # embedding, norm, lm_head and the stacked layer parameters
    q = model.layers.self_attn.q_proj.kernel.get_value()
    assert q.addressable_shards[0].data.shape == (2, 32 // sizes["fsdp"], 32 // sizes["tensor"])  # [layers, in, out]
