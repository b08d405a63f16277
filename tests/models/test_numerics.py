"""Logprob helpers, rematerialisation and RoPE scaling tables."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import ModelConfig, chunked_logprobs, load_pretrained, logprobs_from_logits
from areal_jax.models.decoder import rope_inv_freq

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _jit_grad(loss, model):
    graphdef, state = nnx.split(model)
    return jax.jit(jax.grad(lambda st: loss(nnx.merge(graphdef, st))))(state)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_numpy(temperature: float) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 11)).astype(np.float32) * 3
    targets = rng.integers(0, 11, (2, 5))
    ref = np.take_along_axis(_np_log_softmax(logits / temperature), targets[..., None], -1)[..., 0]
    got = logprobs_from_logits(jnp.asarray(logits), jnp.asarray(targets), temperature)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5)


def test_chunked_logprobs_equal_full_and_grad() -> None:
    model = load_pretrained(FIXTURES / "hf_qwen3")
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 13)), jnp.int32)
    targets = jnp.roll(ids, -1, axis=1)

    def full(m):
        return logprobs_from_logits(m(ids), targets, 0.9)

    def chunked(m):
        lp, _ = chunked_logprobs(m.hidden_states(ids), targets, m.logits_from_hidden, temperature=0.9, chunk_size=4)
        return lp

    np.testing.assert_allclose(np.asarray(chunked(model)), np.asarray(full(model)), atol=1e-5)
    g_full = _jit_grad(lambda m: full(m).sum(), model)
    g_chunk = _jit_grad(lambda m: chunked(m).sum(), model)
    for a, b in zip(jax.tree.leaves(g_full), jax.tree.leaves(g_chunk), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize("policy", [True, "full", "dots"])
def test_remat_gives_same_gradients(policy) -> None:
    plain = load_pretrained(FIXTURES / "hf_llama")
    remat = load_pretrained(FIXTURES / "hf_llama", remat=policy)
    ids = jnp.asarray(np.arange(10)[None] % 96)

    def loss(m):
        return jnp.mean(m(ids) ** 2)

    g1 = jax.tree.leaves(_jit_grad(loss, plain))
    g2 = jax.tree.leaves(_jit_grad(loss, remat))
    for a, b in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_llama3_rope_scaling_bands() -> None:
    base = ModelConfig(model_type="llama", head_dim=64, rope_theta=500000.0)
    scaled = base.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    f0, f1 = rope_inv_freq(base), rope_inv_freq(scaled)
    wavelen = 2 * np.pi / f0
    np.testing.assert_allclose(f1[wavelen < 8192 / 4], f0[wavelen < 8192 / 4])  # high frequencies kept
    np.testing.assert_allclose(f1[wavelen > 8192], f0[wavelen > 8192] / 8, rtol=1e-6)  # low ones divided
    mid = (wavelen > 8192 / 4) & (wavelen < 8192)
    assert mid.any() and np.all(f1[mid] < f0[mid]) and np.all(f1[mid] > f0[mid] / 8)
    with pytest.raises(ValueError, match="yarn"):
        rope_inv_freq(base.replace(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def _random_packed(rng, rows: int, t: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    seg = np.zeros((rows, t), np.int32)
    pos = np.zeros_like(seg)
    for r in range(rows):
        at, k = 0, 1
        while (n := int(rng.integers(1, max_len + 1))) <= t - at - 3:
            seg[r, at : at + n], pos[r, at : at + n] = k, np.arange(n)
            at, k = at + n, k + 1
    return seg, pos


@pytest.mark.parametrize("t,block,window", [(64, 8, 11), (61, 8, 16), (64, 16, 40), (32, 8, 64)])
def test_local_attention_equals_full_within_window(t: int, block: int, window: int) -> None:
    """Block-local attention over packed rows equals full attention when no segment is longer
    than the window, in value and gradient (blocks that do not divide the row are padded)."""
    from areal_jax.models.attention import attend_packed, attend_packed_local

    rng = np.random.default_rng(t + block + window)
    seg, _ = _random_packed(rng, 2, t, window)
    q = jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32) for _ in range(2))
    real = jnp.asarray(seg > 0)[..., None, None]

    def loss(fn, q, k, v):
        return jnp.sum(jnp.where(real, fn(q, k, v), 0.0) ** 2)

    full = lambda q, k, v: attend_packed(q, k, v, jnp.asarray(seg))
    local = lambda q, k, v: attend_packed_local(q, k, v, jnp.asarray(seg), window, block=block)
    np.testing.assert_allclose(np.where(real, local(q, k, v), 0), np.where(real, full(q, k, v), 0), atol=1e-5)
    for a, b in zip(jax.grad(lambda *x: loss(local, *x), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(lambda *x: loss(full, *x), argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_model_attention_window_on_long_packed_rows() -> None:
    model = load_pretrained(FIXTURES / "hf_llama")
    rng = np.random.default_rng(3)
    seg, pos = _random_packed(rng, 2, 600, 150)
    ids = jnp.asarray(rng.integers(0, 96, seg.shape), jnp.int32)
    fwd = jax.jit(lambda m, *a, w=None: m(*a, attention_window=w), static_argnames="w")
    full = fwd(model, ids, jnp.asarray(pos), jnp.asarray(seg))
    local = fwd(model, ids, jnp.asarray(pos), jnp.asarray(seg), w=150)
    real = (seg > 0)[..., None]
    np.testing.assert_allclose(np.where(real, local, 0), np.where(real, full, 0), atol=1e-5)
