"""Fused attention paths (``jax.nn.dot_product_attention``, Pallas splash) against the dense
reference, on packed rows with local windows (also windows shorter than the segments, where they
bind), in value and gradient; the compiled kernels where the backend has them (cuDNN on NVIDIA
GPUs, splash on TPUs; skipped elsewhere); and how ``attention_impl`` resolves per backend."""

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import ModelConfig, load_pretrained
from areal_jax.models import attention as attn
from areal_jax.models.attention import attend, attend_packed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _packed_segments(rng: np.random.Generator, rows: int, t: int, max_len: int) -> np.ndarray:
    """Rows of back-to-back segments 1, 2, ... of lengths up to ``max_len``, then padding (0)."""
    seg = np.zeros((rows, t), np.int32)
    for r in range(rows):
        at, k = 0, 1
        while (n := int(rng.integers(1, max_len + 1))) <= t - at - 3:
            seg[r, at : at + n] = k
            at, k = at + n, k + 1
    return seg


def _qkv(rng: np.random.Generator, b: int, t: int, heads: int = 4, kv_heads: int = 2, d: int = 16):
    q = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32) for _ in range(2))
    return q, k, v


def _segments_of(lengths: list[list[int]], t: int) -> np.ndarray:
    """Rows of segments 1, 2, ... of the given lengths, then padding (0)."""
    seg = np.zeros((len(lengths), t), np.int32)
    for r, row in enumerate(lengths):
        seg[r, : sum(row)] = np.repeat(np.arange(1, len(row) + 1), row)
    return seg


def _banded_dense(seg: np.ndarray, window: int):
    """Dense attention under an explicit mask: causal, within a segment, and at most
    ``window - 1`` keys back (the local-window contract), whatever the segments' lengths."""
    i = np.arange(seg.shape[1])
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    mask = band[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    return lambda q, k, v: attend(q, k, v, jnp.asarray(mask))


def _assert_window_binds(seg: np.ndarray, window: int, q, k, v) -> None:
    """The banded reference is not full attention on these rows: a path that ignored the window
    would fail the comparison."""
    real = np.asarray(seg > 0)[..., None, None]
    gap = np.abs(np.where(real, _banded_dense(seg, window)(q, k, v) - attend_packed(q, k, v, jnp.asarray(seg)), 0))
    assert gap.max() > 0.1, gap.max()


def _check_equals_dense(fn, seg: np.ndarray, q, k, v, atol: float = 1e-5, reference=None) -> None:
    """``fn(q, k, v)`` equals dense attention (``reference``, default full attention within
    segments) on real tokens, and so do the gradients of a loss that reads real tokens only."""
    real = jnp.asarray(seg > 0)[..., None, None]
    dense = reference or (lambda q, k, v: attend_packed(q, k, v, jnp.asarray(seg)))

    def loss(f, q, k, v):
        return jnp.sum(jnp.where(real, f(q, k, v), 0.0) ** 2)

    np.testing.assert_allclose(np.where(real, fn(q, k, v), 0), np.where(real, dense(q, k, v), 0), atol=atol)
    got = jax.grad(lambda *x: loss(fn, *x), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *x: loss(dense, *x), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(got, want, strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=10 * atol)


@pytest.mark.parametrize("window", [None, 12])
def test_dot_product_xla_equals_dense_on_packed_rows(window) -> None:
    rng = np.random.default_rng(0)
    seg = _packed_segments(rng, 2, 48, 12)
    q, k, v = _qkv(rng, 2, 48)
    fn = lambda q, k, v: attn.dot_product_attention_packed(q, k, v, jnp.asarray(seg), window=window,
                                                           implementation="xla")
    _check_equals_dense(fn, seg, q, k, v)


def test_local_window_really_limits_the_look_back() -> None:
    """With a window shorter than a segment the result differs from full attention exactly as
    a dense mask with that window says (``window - 1`` keys back plus the query itself)."""
    rng = np.random.default_rng(1)
    t, w = 20, 5
    seg = np.ones((1, t), np.int32)
    q, k, v = _qkv(rng, 1, t)
    i = np.arange(t)
    band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < w)
    from areal_jax.models.attention import attend

    want = attend(q, k, v, jnp.asarray(band)[None])
    got = attn.dot_product_attention_packed(q, k, v, jnp.asarray(seg), window=w, implementation="xla")
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("window", [5, 24])
def test_dot_product_window_shorter_than_segments(window: int) -> None:
    """Packed segments longer than the window (the window binds): value and gradient equal the
    banded dense reference."""
    rng = np.random.default_rng(5)
    seg = _segments_of([[40, 20], [7, 50]], 64)
    q, k, v = _qkv(rng, 2, 64)
    _assert_window_binds(seg, window, q, k, v)
    fn = lambda q, k, v: attn.dot_product_attention_packed(q, k, v, jnp.asarray(seg), window=window,
                                                           implementation="xla")
    _check_equals_dense(fn, seg, q, k, v, reference=_banded_dense(seg, window))


@pytest.mark.slow
@pytest.mark.parametrize(("t", "lengths", "window"), [(160, [[100, 50], [30, 120]], 9),
                                                      (300, [[190, 100], [60, 230]], 130)],
                         ids=["one_block", "across_blocks"])
def test_splash_interpret_window_shorter_than_segments(t: int, lengths: list, window: int) -> None:
    """Splash (Pallas interpret mode) with packed segments longer than the window, in value and
    gradient against the banded dense reference: within one 256-token block, and with 128-token
    blocks where the window reaches back across a block boundary."""
    rng = np.random.default_rng(6)
    seg = _segments_of(lengths, t)
    q, k, v = _qkv(rng, 2, t)
    _assert_window_binds(seg, window, q, k, v)
    fn = lambda q, k, v: attn.splash_attention_packed(q, k, v, jnp.asarray(seg), window=window, interpret=True)
    _check_equals_dense(fn, seg, q, k, v, reference=_banded_dense(seg, window))


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 40])
def test_splash_interpret_equals_dense_on_packed_rows(window) -> None:
    """The Pallas splash kernel in interpret mode; 200 tokens pad to one 256-token block."""
    rng = np.random.default_rng(2)
    seg = _packed_segments(rng, 2, 200, 40)
    q, k, v = _qkv(rng, 2, 200)
    fn = lambda q, k, v: attn.splash_attention_packed(q, k, v, jnp.asarray(seg), window=window, interpret=True)
    _check_equals_dense(fn, seg, q, k, v)


def _cuda_gpu() -> bool:
    """An NVIDIA GPU backend, where ``dot_product`` runs cuDNN's fused flash attention."""
    return jax.default_backend() == "gpu" and "cuda" in jax.devices()[0].client.platform_version.lower()


def _check_bfloat16_kernel_equals_dense(fn, window: int | None) -> None:
    """``fn(q, k, v, segment_ids)`` on bfloat16 inputs (two rows packed with segments longer than the window)
    against float32 dense attention over the same, bfloat16-representable values: outputs within
    bfloat16 rounding, gradients within 2% in norm."""
    rng = np.random.default_rng(7)
    t = 256
    seg = _segments_of([[150, 80], [40, 200]], t)
    q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in _qkv(rng, 2, t, heads=8, kv_heads=2, d=64))
    if window is not None:
        _assert_window_binds(seg, window, q, k, v)
    dense = _banded_dense(seg, window) if window is not None else (lambda *x: attend_packed(*x, jnp.asarray(seg)))
    kernel = lambda *x: fn(*(a.astype(jnp.bfloat16) for a in x), jnp.asarray(seg)).astype(jnp.float32)
    real = jnp.asarray(seg > 0)[..., None, None]
    np.testing.assert_allclose(np.where(real, kernel(q, k, v), 0), np.where(real, dense(q, k, v), 0), atol=3e-2)
    loss = lambda f, *x: jnp.sum(jnp.where(real, f(*x), 0.0) ** 2)
    got = jax.grad(lambda *x: loss(kernel, *x), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *x: loss(dense, *x), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want, strict=True):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < 2e-2, (name, rel)


@pytest.mark.skipif(not _cuda_gpu(), reason=f"cuDNN flash attention needs an NVIDIA GPU; the backend here is "
                                            f"{jax.default_backend()}")
@pytest.mark.parametrize("window", [None, 48])
def test_cudnn_bfloat16_equals_dense_on_packed_rows(window: int | None) -> None:
    """``attention_impl="dot_product"`` on GPU: cuDNN in bfloat16, packed segments as its mask,
    the local window as its sliding window."""
    fn = partial(attn.dot_product_attention_packed, window=window, implementation="cudnn")
    _check_bfloat16_kernel_equals_dense(fn, window)


@pytest.mark.skipif(not (jax.default_backend() == "tpu" and attn.splash_available()),
                    reason=f"the compiled splash kernel needs a TPU with Pallas TPU ops; the backend here is "
                           f"{jax.default_backend()}")
@pytest.mark.parametrize("window", [None, 48])
def test_splash_on_tpu_bfloat16_equals_dense_on_packed_rows(window: int | None) -> None:
    """``attention_impl="splash"`` compiled for the TPU (not interpreted), in bfloat16."""
    fn = partial(attn.splash_attention_packed, window=window, interpret=False)
    _check_bfloat16_kernel_equals_dense(fn, window)


def _packed_model_input(rows: int, t: int, seed: int = 3) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    seg = _packed_segments(rng, rows, t, 12)
    pos = np.zeros_like(seg)
    for r in range(rows):
        for s in np.unique(seg[r][seg[r] > 0]):
            at = np.nonzero(seg[r] == s)[0]
            pos[r, at] = np.arange(len(at))
    ids = rng.integers(0, 96, seg.shape).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)


@pytest.mark.parametrize("impl", ["dot_product", "auto"])
def test_model_logits_with_each_cpu_impl_equal_dense(impl: str) -> None:
    ids, pos, seg = _packed_model_input(2, 40)
    fwd = jax.jit(lambda m, *a, w=None: m(*a, attention_window=w), static_argnames="w")
    dense = load_pretrained(FIXTURES / "hf_qwen3")
    other = load_pretrained(FIXTURES / "hf_qwen3", attention_impl=impl)
    real = np.asarray(seg > 0)[..., None]
    for w in (None, 12):
        np.testing.assert_allclose(np.where(real, fwd(other, ids, pos, seg, w=w), 0),
                                   np.where(real, fwd(dense, ids, pos, seg, w=w), 0), atol=1e-5)


@pytest.mark.slow
def test_model_with_splash_under_a_mesh_equals_dense() -> None:
    """Splash inside shard_map on 8 fake devices (batch over data x fsdp, heads over tensor)."""
    from sharding import MeshConfig, activate, logical_to_sharding, make_mesh

    mesh = make_mesh(MeshConfig(2, 2, 2))
    ids, pos, seg = _packed_model_input(4, 60)
    dense = load_pretrained(FIXTURES / "hf_qwen3")
    want = np.asarray(dense(ids, pos, seg))
    model = load_pretrained(FIXTURES / "hf_qwen3", mesh=mesh, attention_impl="splash")
    put = lambda x: jax.device_put(x, logical_to_sharding(("batch", "length"), mesh))
    with activate(mesh):
        got = np.asarray(jax.jit(lambda m, *a: m(*a))(model, put(ids), put(pos), put(seg)))
    real = np.asarray(seg > 0)[..., None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5)


@pytest.mark.parametrize(
    "impl,dtype,backend,expected",
    [
        ("auto", "float32", "cpu", "dense"),
        ("auto", "bfloat16", "cpu", "dense"),
        ("auto", "bfloat16", "gpu", "dot_product"),
        ("auto", "float32", "gpu", "dense"),  # float32 stays on the reference path
        ("auto", "bfloat16", "tpu", "splash"),
        ("auto", "float32", "tpu", "dense"),
        ("dot_product", "float32", "cpu", "dot_product"),
        ("dense", "bfloat16", "gpu", "dense"),
    ],
)
def test_auto_resolves_per_backend(impl: str, dtype: str, backend: str, expected: str) -> None:
    assert attn.resolve_attention_impl(impl, dtype, backend) == expected


def test_impossible_choices_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        attn.resolve_attention_impl("dot_product", "float32", "gpu")
    with pytest.raises(ValueError, match="attention_impl='flash'"):
        ModelConfig(attention_impl="flash")
    # A jax without the Pallas TPU ops: auto falls back to dense, an explicit request says why.
    import sys

    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.ops.tpu.splash_attention", None)
    attn._splash_modules.cache_clear()
    try:
        assert attn.resolve_attention_impl("auto", "bfloat16", "tpu") == "dense"
        with pytest.raises(ImportError, match="attention_impl='splash' needs"):
            attn.resolve_attention_impl("splash", "bfloat16", "tpu")
    finally:
        attn._splash_modules.cache_clear()
