"""Fused q/k/v and gate/up projections (``models.fused``): the per-shard column layout, logits
equal to the separate projections', and HF tensors in and out unchanged (load, export, a partial
update, a staged push, a trainer's state fused for serving)."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.inference.weights import WeightStage
from areal_jax.models import Decoder, ModelConfig, assign_hf_tensors, hf_tensor_specs, iter_hf_tensors, load_pretrained
from areal_jax.models.attention import PagedWork
from areal_jax.models.fused import fuse_projections, fuse_state, gate_up_layout, qkv_layout, qkv_shards
from areal_jax.models.hf_write import save_pretrained

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_layout_gives_each_shard_its_own_heads() -> None:
    # 4 query heads, 2 KV heads, head_dim 2: [q | k | v] is columns 0-7 | 8-11 | 12-15.
    one = qkv_layout(4, 2, 2, 1)
    assert one.order == tuple(range(16))
    two = np.asarray(qkv_layout(4, 2, 2, 2).order).reshape(2, -1)
    assert two[0].tolist() == [0, 1, 2, 3, 8, 9, 12, 13]  # q heads 0-1, k head 0, v head 0
    assert two[1].tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    # Wider than the KV heads: shards 0-1 hold a copy of KV head 0, shards 2-3 of head 1.
    four = np.asarray(qkv_layout(4, 2, 2, 4).order).reshape(4, -1)
    assert four[:, 2:4].tolist() == [[8, 9], [8, 9], [10, 11], [10, 11]]
    inv = qkv_layout(4, 2, 2, 4).inverse()
    assert (np.asarray(qkv_layout(4, 2, 2, 4).order)[inv] == np.arange(16)).all()
    assert qkv_shards(4, 2, 3) == 1  # heads do not split 3 ways: the plain layout
    assert np.asarray(gate_up_layout(4, 2).order).reshape(2, -1).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]


def _models(model_type: str) -> tuple[Decoder, Decoder]:
    model = Decoder(ModelConfig(model_type=model_type, vocab_size=96), rngs=nnx.Rngs(0))
    return model, fuse_projections(model)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])  # llama's attention is qwen2's without biases
def test_fused_logits_equal_separate(model_type: str) -> None:
    """Training forward, KV-cache decode and paged decode: the same logits from one matmul as
    from three (qwen2: q/k/v biases; qwen3: q/k norms)."""
    model, fused = _models(model_type)
    assert {"qkv_proj", "gate_up_proj"} <= set(vars(fused.layers.self_attn)) | set(vars(fused.layers.mlp))
    assert not hasattr(fused.layers.self_attn, "q_proj") and not hasattr(fused.layers.mlp, "up_proj")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(model(ids)), atol=1e-6)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    a, _ = model.decode(ids, pos, model.init_cache(2, 16), kv_len=16)
    b, _ = fused.decode(ids, pos, fused.init_cache(2, 16), kv_len=16)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    # Paged: row 0 on pages 1-2, row 1 on pages 3-4 (pages of 4 tokens).
    pages = np.array([[1, 1, 1, 1, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4]])
    kw = dict(write_pages=jnp.asarray(pages), write_offsets=jnp.asarray(np.tile(np.arange(7) % 4, (2, 1))),
              work=PagedWork(jnp.asarray([0, 0, 1, 1]), jnp.asarray([1, 2, 3, 4]), jnp.asarray([0, 4, 0, 4])))
    c, _ = model.decode_paged(ids, pos, model.init_paged_cache(4, 4), **kw)
    d, _ = fused.decode_paged(ids, pos, fused.init_paged_cache(4, 4), **kw)
    np.testing.assert_allclose(np.asarray(d), np.asarray(c), atol=1e-6)
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), atol=1e-4)  # and paged is decode


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_hf_tensors_in_and_out_unchanged(family: str, tmp_path: Path) -> None:
    """A fused load of a HF checkpoint exports exactly the separate model's tensors (names,
    shapes, values; HF and our own layout); a partial update by HF name and a staged push land
    in the right columns."""
    model = load_pretrained(FIXTURES / f"hf_{family}")
    fused = load_pretrained(FIXTURES / f"hf_{family}", fuse_projections=True)
    for hf_layout in (True, False):
        assert hf_tensor_specs(fused, hf_layout=hf_layout) == hf_tensor_specs(model, hf_layout=hf_layout)
        ours, theirs = dict(iter_hf_tensors(fused, hf_layout=hf_layout)), dict(iter_hf_tensors(model,
                                                                                              hf_layout=hf_layout))
        assert ours.keys() == theirs.keys()
        for name in ours:
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    save_pretrained(fused, tmp_path / "out")
    again = load_pretrained(tmp_path / "out")  # the export loads as a separate model
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 9)), jnp.int32)
    np.testing.assert_allclose(np.asarray(again(ids)), np.asarray(model(ids)), atol=1e-6)

    other = dict(iter_hf_tensors(Decoder(model.config, rngs=nnx.Rngs(5))))
    some = {k: v for k, v in other.items() if "layers.1." in k and any(p in k for p in ("k_proj", "up_proj", "v_proj"))}
    assert any(k.endswith("k_proj.weight") for k in some) and any(k.endswith("up_proj.weight") for k in some)
    assign_hf_tensors(model, some)
    assign_hf_tensors(fused, some)
    ours, theirs = dict(iter_hf_tensors(fused)), dict(iter_hf_tensors(model))
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(model(ids)), atol=1e-6)

    stage = WeightStage(fused, hf_layout=False)  # our own layout, as an HTTP push from our trainer sends it
    stage.add(dict(iter_hf_tensors(Decoder(model.config, rngs=nnx.Rngs(5)), hf_layout=False)))
    assert not stage.missing()
    nnx.update(fused, stage.finish())
    target = Decoder(model.config, rngs=nnx.Rngs(5))
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(target(ids)), atol=1e-6)


def test_trainer_state_fused_for_serving() -> None:
    """``fuse_state``: a separate model's parameters in the served fused tree (what an in-process
    handover does); the arrays not fused are the same buffers, not copies."""
    model, fused = _models("qwen2")
    trained = Decoder(model.config, rngs=nnx.Rngs(9))
    state = fuse_state(fused, nnx.state(trained))
    assert fuse_state(fused, state) is not None  # an already fused state passes through
    nnx.update(fused, state)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 96, (2, 5)), jnp.int32)
    np.testing.assert_allclose(np.asarray(fused(ids)), np.asarray(trained(ids)), atol=1e-6)
    assert fused.layers.mlp.down_proj.kernel.get_value() is trained.layers.mlp.down_proj.kernel.get_value()
    with pytest.raises(ValueError, match="no source in the given state"):
        fuse_state(fused, nnx.state(trained.layers))
