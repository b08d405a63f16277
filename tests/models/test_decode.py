"""KV-cache decoding reproduces the full forward, step by step, for every family."""

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Decoder, ModelConfig, load_pretrained

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@partial(jax.jit, static_argnames=("kv_len",))
def decode(model, ids, positions, cache, kv_len, slots=None):
    return model.decode(ids, positions, cache, kv_len=kv_len, slots=slots)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_prefill_then_steps_match_full_forward(family: str) -> None:
    model = load_pretrained(FIXTURES / f"hf_{family}")
    rng = np.random.default_rng(0)
    total, prompt = 20, 6
    ids = jnp.asarray(rng.integers(0, 96, (3, total)), jnp.int32)
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
    cache = model.init_cache(num_slots=3, max_len=32)
    pos = jnp.broadcast_to(jnp.arange(8), (3, 8))
    # Prefill in a bucket of 8: the two padding positions write junk that later steps overwrite.
    prefill_ids = jnp.pad(ids[:, :prompt], ((0, 0), (0, 2)))
    logits, cache = decode(model, prefill_ids, pos, cache, kv_len=8)
    np.testing.assert_allclose(np.asarray(logits[:, :prompt]), full[:, :prompt], atol=1e-4)
    for t in range(prompt, total):
        kv_len = 16 if t < 16 else 32  # a bucketed bound on attended positions
        step, cache = decode(model, ids[:, t : t + 1], jnp.full((3, 1), t), cache, kv_len=kv_len)
        np.testing.assert_allclose(np.asarray(step[:, 0]), full[:, t], atol=1e-4, err_msg=f"step {t}")


def test_decode_into_chosen_slots() -> None:
    """Rows write into and read from the slots they name; other slots stay untouched."""
    model = load_pretrained(FIXTURES / "hf_qwen2")
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.integers(0, 96, (1, 10)), jnp.int32)
    full = np.asarray(model(a))
    cache = model.init_cache(num_slots=4, max_len=16)
    _, cache = decode(model, a[:, :9], jnp.arange(9)[None], cache, kv_len=16, slots=jnp.array([2]))
    assert float(jnp.abs(cache.k[0][0]).max()) == 0.0  # slot 0 never written
    step, _ = decode(model, a[:, 9:], jnp.array([[9]]), cache, kv_len=16, slots=jnp.array([2]))
    np.testing.assert_allclose(np.asarray(step[0, 0]), full[0, 9], atol=1e-4)


def test_unrolled_layers_decode_like_the_scan() -> None:
    """``decode_unroll`` changes only how the layer scan is compiled: 2 layers per iteration (with
    a remainder, at 3 layers) or all 3 give the scan's logits and cache."""
    rng = np.random.default_rng(2)
    ids = jnp.asarray(rng.integers(0, 128, (2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    outs = []
    for unroll in (1, 2, 3):
        model = Decoder(ModelConfig(num_hidden_layers=3, decode_unroll=unroll), rngs=nnx.Rngs(0))
        logits, cache = decode(model, ids, pos, model.init_cache(2, 16), kv_len=8)
        step, cache = decode(model, ids[:, -1:], jnp.full((2, 1), 7), cache, kv_len=8)
        outs.append((logits, step, cache))
    for other in outs[1:]:
        for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(other), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    with pytest.raises(ValueError, match="decode_unroll=0"):
        ModelConfig(decode_unroll=0)
