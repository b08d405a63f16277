"""Fused projections on a tensor mesh (8 fake CPU devices): each tensor shard of a fused ``qkv_proj``
holds its own query heads and the KV heads they read (copies when the tensor axis is wider than
the KV heads), the split needs no more communication than three separate matmuls, and the
logits are the single-device ones."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import load_pretrained
from areal_jax.models.fused import fuse_projections, qkv_layout
from areal_jax.models.tiny import make_tiny_checkpoint
from sharding import MeshConfig, activate, make_mesh


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fused") / "m", model_type="qwen2", seed=4)


def _collectives(hlo: str) -> int:
    return len(re.findall(r"\b(all-gather|all-to-all|collective-permute|all-reduce)(-start)?\(", hlo))


@pytest.mark.parametrize("tensor", [2, 4])
def test_fused_shards_hold_their_own_heads(ckpt: Path, tensor: int) -> None:
    single = load_pretrained(ckpt)
    cfg = single.config
    nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=tensor))
    separate = load_pretrained(ckpt, mesh=mesh)
    fused = load_pretrained(ckpt, mesh=mesh, fuse_projections=True)
    assert fused.layers.self_attn.qkv_shards == tensor and fused.layers.mlp.gate_up_shards == tensor

    kernel = fused.layers.self_attn.qkv_proj.kernel.get_value()
    order = np.asarray(qkv_layout(nh, kvh, d, tensor).order)
    for shard in kernel.addressable_shards:
        cols = order[shard.index[-1]]
        assert shard.data.shape[-1] == len(order) // tensor  # split over the tensor axis
        q_heads = sorted({c // d for c in cols if c < nh * d})
        kv_heads = sorted({(c - nh * d) // d % kvh for c in cols if c >= nh * d})
        assert len(q_heads) == nh // tensor
        assert kv_heads == sorted({h // (nh // kvh) for h in q_heads})  # the KV heads those queries read

    # Fusing a loaded separate model gives the same arrays on the same shardings.
    again = fuse_projections(separate)
    for name in ("qkv_proj", "gate_up_proj"):
        module = "self_attn" if name == "qkv_proj" else "mlp"
        a = getattr(getattr(again.layers, module), name).kernel.get_value()
        b = getattr(getattr(fused.layers, module), name).kernel.get_value()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)

    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12), ids.shape)

    def step(m, cache):
        out, _ = m.decode(ids, positions, cache, kv_len=16)
        return out

    ref = step(single, single.init_cache(4, 16))
    hlo = {}
    with activate(mesh):
        for name, model in (("separate", separate), ("fused", fused)):
            cache = model.init_cache(4, 16)
            fn = jax.jit(step)
            np.testing.assert_allclose(np.asarray(fn(model, cache)), np.asarray(ref), atol=1e-5)
            hlo[name] = fn.lower(model, cache).compile().as_text()
    assert _collectives(hlo["fused"]) <= _collectives(hlo["separate"]), \
        (_collectives(hlo["fused"]), _collectives(hlo["separate"]))
