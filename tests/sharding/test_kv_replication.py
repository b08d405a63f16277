"""A tensor axis wider than the number of KV heads (Qwen2.5-0.5B/1.5B have 2): on 8 fake devices,
a 1x2x4 mesh replicates each KV head over the extra tensor shards, in the weights, the
activations and the KV cache, and gives the single-device logits and greedy tokens."""

import asyncio
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.models import KVCache, load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from sharding import MeshConfig, activate, logical_to_sharding, make_mesh

WIDE = MeshConfig(data=1, fsdp=2, tensor=4)  # tiny model: 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kv") / "m", model_type="qwen2", seed=3)


def test_forward_and_decode_match_single_device(ckpt: Path) -> None:
    single = load_pretrained(ckpt)
    assert single.config.num_key_value_heads == 2
    mesh = make_mesh(WIDE)
    model = load_pretrained(ckpt, mesh=mesh)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 100, (4, 12)), jnp.int32)

    # The k/v projections are replicated over the tensor axis; q is still split by heads.
    k_spec = model.layers.self_attn.k_proj.kernel[...].sharding.spec
    assert "tensor" not in jax.tree.leaves(tuple(k_spec))
    assert "tensor" in jax.tree.leaves(tuple(model.layers.self_attn.q_proj.kernel[...].sharding.spec))

    with activate(mesh):
        logits = jax.jit(lambda m, x: m(x))(model, jax.device_put(ids, logical_to_sharding(("batch", "length"), mesh)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(single(ids)), atol=1e-5)

    positions = jnp.broadcast_to(jnp.arange(12), ids.shape)

    def prefill_then_step(m, cache):
        out, cache = m.decode(ids, positions, cache, kv_len=16)
        nxt = jnp.argmax(out[:, -1], -1)[:, None]
        step, cache = m.decode(nxt, positions[:, -1:] + 1, cache, kv_len=16)
        return out, step

    ref = prefill_then_step(single, single.init_cache(4, 16))
    with activate(mesh):
        cache = model.init_cache(4, 16)
        # Each of the 2 KV heads is held by 2 of the 4 tensor shards: the cache has 4 heads and
        # every device keeps one of them.
        assert cache.k.shape == (2, 4, 4, 16, 16) and cache.v.shape == (2, 4, 4, 16, 16)
        cache = KVCache(*(jax.device_put(x, logical_to_sharding(axes, mesh))
                          for x, axes in zip(cache, KVCache.axes(), strict=True)))
        assert {s.data.shape[2] for s in cache.k.addressable_shards} == {1}
        got = jax.jit(prefill_then_step)(model, cache)
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_engine_greedy_on_a_wide_tensor_mesh(ckpt: Path) -> None:
    prompts = [[5, 9, 14], [30, 31, 32, 33, 34, 35, 36], [77] * 12, [100, 4]]
    cfg = EngineConfig(num_slots=4, max_seq_len=32, max_prefill_batch=4, decode_steps=4, lanes=1)
    sp = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)

    async def generate(engine):
        await engine.start()
        try:
            outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, sp))
                                          for p in prompts))
        finally:
            await engine.stop()
        return [o.output_ids for o in outs], [o.output_logprobs for o in outs]

    single_ids, single_lp = asyncio.run(generate(Engine(load_pretrained(ckpt), cfg)))
    mesh = make_mesh(WIDE)
    engine = Engine(load_pretrained(ckpt, mesh=mesh), cfg, mesh=mesh)
    ids, lp = asyncio.run(generate(engine))
    assert ids == single_ids
    np.testing.assert_allclose(np.concatenate(lp), np.concatenate(single_lp), atol=1e-4)
    assert engine._lanes[0].cache.k.shape[2] == 4


def test_tensor_axis_that_does_not_fit_the_kv_heads_is_a_clear_error(ckpt: Path) -> None:
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=3), devices=jax.devices()[:3])
    with pytest.raises(ValueError, match=r"3 ways.*num_key_value_heads=2"):
        load_pretrained(ckpt, mesh=mesh)
