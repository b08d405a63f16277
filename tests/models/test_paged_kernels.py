"""The maintained paged-attention kernels (``models.paged_kernels``) against the XLA gather path
(``attention.attend_ragged``) and a NumPy transcription of attention over each row's own pages.

Pallas GPU ``paged_attention`` runs here in interpret mode. The TPU ``ragged_paged_attention``
kernel does not run on a CPU in this JAX (its TPU interpret mode has no ref reshape, and the
generic interpreter fails on its scalar-prefetch indices), so its inputs are tested through the
kernel module's own reference of the same signature (``ref_ragged_paged_attention``, the kernel's
documented semantics): a wrong k/v interleave, page table, length or query packing fails there.

Cases: ragged lengths, a page boundary, a row with no tokens, two rows whose tables share a
prompt page, decode (one query per row) and prefill / mixed chunks (several, with padding),
float32 and bfloat16."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.inference.pages import paged_work
from areal_jax.models import paged_kernels
from areal_jax.models.attention import PagedWork, attend_ragged
from areal_jax.models.paged_kernels import (
    attend_paged_gpu,
    attend_ragged_tpu,
    ragged_inputs,
    resolve_attention_backend,
    unpack,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SIZE, NH, KVH = 4, 4, 2
# Row lengths: one token, exactly one page, one past a page boundary, a long row, an empty row,
# and a row that shares row 3's first page (a group's prompt page).
LENS = [1, 4, 5, 15, 0, 7]


def _case(t: int, dtype: str, d: int, seed: int = 0):
    """Pool pages, queries (the last ``t`` tokens of each row; earlier slots padding at -1),
    and the work list of ``LENS`` with pages scattered over the pool."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(np.arange(1, 25)).tolist()
    tables = []
    for n in LENS:
        count = -(-n // SIZE)
        tables.append(perm[:count])
        del perm[:count]
    tables[5] = [tables[3][0], tables[5][0]]  # row 5 reads row 3's first page as its own
    k_pages = rng.normal(size=(25, KVH, d, SIZE))
    v_pages = rng.normal(size=(25, KVH, SIZE, d))
    q = rng.normal(size=(len(LENS), t, NH, d))
    q_pos = np.array([[n - t + j if n - t + j >= 0 else -1 for j in range(t)] for n in LENS], np.int32)
    work = paged_work(tables, LENS, SIZE, size=16)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k_pages), cast(v_pages), jnp.asarray(q_pos), PagedWork(*map(jnp.asarray, work))


def _gathered(k_pages: jax.Array, v_pages: jax.Array, work: PagedWork) -> tuple[jax.Array, jax.Array]:
    return k_pages[work.pages], v_pages[work.pages]


def _tolerance(values: jax.Array) -> float:
    """Both paths combine the same inputs; they differ in summation order and, in bfloat16, in
    where the probabilities (relative rounding 2**-8) and the output are rounded (and the GPU
    kernel's queries, pre-scaled by 1/sqrt(d): scores of a few units move by 2**-8 of themselves):
    an output is a convex combination of values, so the difference is a few roundings of
    ``max |v|``. Measured: at most 2**-6 in bfloat16 for a tolerance of about 0.05 here."""
    eps = float(jnp.finfo(values.dtype).eps)
    return eps * float(jnp.abs(values.astype(jnp.float32)).max()) * (32 if values.dtype == jnp.float32 else 2)


def _assert_real_rows_equal(got: jax.Array, want: jax.Array, q_pos: jax.Array, atol: float) -> None:
    real = np.asarray(q_pos) >= 0
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_decode_kernel_matches_the_xla_path(dtype: str) -> None:
    """Pallas GPU paged attention (interpret mode), one query per row, against the XLA path."""
    # d = 32: 1/sqrt(d) is no power of two, so the kernel's pre-scaled bfloat16 queries round
    q, k_pages, v_pages, q_pos, work = _case(1, dtype, d=32)
    keys, values = _gathered(k_pages, v_pages, work)
    got = attend_paged_gpu(q, keys, values, q_pos, work, interpret=True)
    want = attend_ragged(q, keys, values, q_pos, work)
    _assert_real_rows_equal(got, want, q_pos, _tolerance(values))
    assert not np.asarray(got[4], np.float32).any()  # the empty row reads nothing and gets 0


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tpu_ragged_inputs_through_the_kernels_reference_match_the_xla_path(t: int, dtype: str) -> None:
    """The ragged kernel's inputs built from the work list (combined k/v pages, kv_lens, page
    table, packed queries and cu_q_lens) give the XLA path's output under the kernel's semantics,
    for decode rows (t = 1) and prefill chunks with padding queries (t = 3)."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    q, k_pages, v_pages, q_pos, work = _case(t, dtype, d=8)
    keys, values = _gathered(k_pages, v_pages, work)
    got = attend_ragged_tpu(q, keys, values, q_pos, work, kernel=ref_ragged_paged_attention)
    want = attend_ragged(q, keys, values, q_pos, work)
    _assert_real_rows_equal(got, want, q_pos, _tolerance(values))
    assert not np.asarray(got[np.asarray(q_pos) < 0], np.float32).any()  # padding queries get 0


def test_ragged_inputs_follow_the_kernels_documented_layout() -> None:
    """Against a NumPy transcription of the kernel's documented input contract: sequence ``i``'s
    queries are ``q[cu_q_lens[i]:cu_q_lens[i + 1]]`` at positions ``kv_len - q_len ..``; its
    token ``j``'s key is ``kv_pages[page_indices[i, j // page], j % page, 2h]`` and its value
    ``... 2h + 1``."""
    q, k_pages, v_pages, q_pos, work = _case(3, "float32", d=8)
    keys, values = _gathered(k_pages, v_pages, work)
    x = ragged_inputs(q, keys, values, q_pos, work)
    q_np, k_np, v_np, pos = map(np.asarray, (q, k_pages, v_pages, q_pos))
    kv, indices = np.asarray(x.kv_pages), np.asarray(x.page_indices)
    assert int(x.num_seqs[0]) == len(LENS)
    assert np.asarray(x.kv_lens).tolist() == LENS
    for i, n in enumerate(LENS):
        real = np.flatnonzero(pos[i] >= 0)
        lo, hi = int(x.cu_q_lens[i]), int(x.cu_q_lens[i + 1])
        assert hi - lo == len(real)
        np.testing.assert_array_equal(np.asarray(x.q[lo:hi]), q_np[i, real])
        assert (pos[i, real] == n - len(real) + np.arange(len(real))).all()
        table = [int(p) for p in np.asarray(work.pages)[np.asarray(work.rows) == i]][: -(-n // SIZE)]
        for j in range(n):
            page, slot = table[j // SIZE], j % SIZE
            combined = kv[indices[i, j // SIZE], slot]
            np.testing.assert_array_equal(combined[0::2], k_np[page, :, :, slot])
            np.testing.assert_array_equal(combined[1::2], v_np[page, :, slot])


def test_a_wrong_layout_or_page_table_fails_the_comparison() -> None:
    """The comparison above is sharp: k and v swapped in the combined pages, or two rows' page
    tables exchanged, give outputs far outside the tolerance."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    q, k_pages, v_pages, q_pos, work = _case(1, "float32", d=8)
    keys, values = _gathered(k_pages, v_pages, work)
    want = np.asarray(attend_ragged(q, keys, values, q_pos, work))
    x = ragged_inputs(q, keys, values, q_pos, work)
    n, size, heads, d = x.kv_pages.shape
    swapped = x.kv_pages.reshape(n, size, heads // 2, 2, d)[:, :, :, ::-1].reshape(x.kv_pages.shape)
    tables = x.page_indices.at[jnp.array([2, 3])].set(x.page_indices[jnp.array([3, 2])])
    real = np.asarray(q_pos)[:, 0] >= 0
    for bad in (x._replace(kv_pages=swapped), x._replace(page_indices=tables)):
        out = ref_ragged_paged_attention(bad.q, bad.kv_pages, bad.kv_lens, bad.page_indices, bad.cu_q_lens,
                                         bad.num_seqs, sm_scale=1 / np.sqrt(d))
        got = unpack(out, bad, want.shape)
        assert np.abs(np.asarray(got)[real] - want[real]).max() > 100 * _tolerance(values)


def test_the_backend_choice_follows_the_hardware_and_explicit_choices_fail_loudly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    shape = dict(head_dim=128, page_size=16, num_heads=8, num_kv_heads=2)
    # Until a device run has checked the kernels, auto runs the XLA path everywhere.
    for hw in ("cpu", "gpu", "tpu"):
        assert resolve_attention_backend("auto", dtype="bfloat16", backend=hw, **shape) == "native"
    monkeypatch.setattr(paged_kernels, "AUTO_TAKES_KERNELS", True)
    assert resolve_attention_backend("auto", dtype="bfloat16", backend="cpu", **shape) == "native"
    assert resolve_attention_backend("auto", dtype="bfloat16", backend="gpu", **shape) == "fa"
    assert resolve_attention_backend("auto", dtype="bfloat16", backend="tpu", **shape) == "fa"
    assert resolve_attention_backend("auto", dtype="float32", backend="gpu", **shape) == "native"
    assert resolve_attention_backend("fa", dtype="float32", backend="gpu", **shape) == "fa"
    assert resolve_attention_backend("native", dtype="bfloat16", backend="tpu", **shape) == "native"
    assert resolve_attention_backend("auto", dtype="bfloat16", backend="tpu", **{**shape, "head_dim": 64}) == "native"
    with pytest.raises(ValueError, match="--attention-backend fa: no paged attention kernel runs on 'cpu'.*native"):
        resolve_attention_backend("fa", dtype="bfloat16", backend="cpu", **shape)
    with pytest.raises(ValueError, match="head_dim a multiple of 128, not 64"):
        resolve_attention_backend("fa", dtype="bfloat16", backend="tpu", **{**shape, "head_dim": 64})
    with pytest.raises(ValueError, match="--page-size a power of two >= 16, not 4"):
        resolve_attention_backend("fa", dtype="bfloat16", backend="gpu", **{**shape, "page_size": 4})
    with pytest.raises(ValueError, match="choose one of"):
        resolve_attention_backend("flashinfer", dtype="bfloat16", backend="gpu", **shape)


def test_the_paged_decoder_with_the_kernel_matches_the_xla_path() -> None:
    """The tiny Qwen2 through ``decode_paged`` with ``fa`` (on this CPU: the GPU decode kernel in
    interpret mode for decode rows, the XLA path for the prefill chunk) gives the ``native``
    model's logits, over a prompt crossing a page boundary and decode steps after it."""
    from areal_jax.inference.pages import PageAllocator, PageTable
    from areal_jax.models import load_pretrained

    model = load_pretrained(FIXTURES / "hf_qwen2")
    rng = np.random.default_rng(3)
    lens, steps = [6, 3], 3
    ids = rng.integers(0, 96, (2, max(lens) + steps)).astype(np.int32)

    def run(backend: str) -> list[np.ndarray]:
        step = jax.jit(lambda m, *a: m.decode_paged(a[0], a[1], a[2], write_pages=a[3], write_offsets=a[4],
                                                     work=PagedWork(*a[5]), backend=backend))
        pool = PageAllocator(num_pages=8, page_size=SIZE)
        cache = model.init_paged_cache(pool.num_pages, SIZE)
        tables = [PageTable(pool) for _ in lens]
        outs = []
        for s in range(steps + 1):
            width = max(lens) if s == 0 else 1
            starts = [0, 0] if s == 0 else [n + s - 1 for n in lens]
            tok, pos = np.zeros((2, width), np.int32), np.full((2, width), -1, np.int32)
            wp, wo = np.zeros((2, width), np.int32), np.zeros((2, width), np.int32)
            for i, (t, st) in enumerate(zip(tables, starts, strict=True)):
                n = lens[i] if s == 0 else 1
                t.reserve(st + n)
                tok[i, :n], pos[i, :n] = ids[i, st:st + n], np.arange(st, st + n)
                wp[i, :n], wo[i, :n] = t.write_slots(st, st + n)
            ends = [st + (lens[i] if s == 0 else 1) for i, st in enumerate(starts)]
            work = tuple(map(jnp.asarray, paged_work([t.pages for t in tables], ends, SIZE, size=8)))
            logits, cache = step(model, *map(jnp.asarray, (tok, pos)), cache, jnp.asarray(wp), jnp.asarray(wo), work)
            outs.append(np.asarray(logits)[np.asarray(pos) >= 0])
        return outs

    native, fa = run("native"), run("fa")
    for s, (a, b) in enumerate(zip(native, fa, strict=True)):
        np.testing.assert_allclose(b, a, atol=1e-4, err_msg=f"step {s}")


def test_the_kernel_runs_inside_the_engines_bucketed_work_list() -> None:
    """``attend_work`` with a live count (the engine's fixed-length list, read through a
    ``lax.switch`` over ``work_sizes``) gives the same decode output with ``fa`` as ``native``."""
    from areal_jax.models.paged import attend_work, work_sizes

    q, k_pages, v_pages, q_pos, _ = _case(1, "float32", d=16)
    tables = [[1], [2], [3, 4], [5, 6, 7, 8], [], [5, 9]]
    live = sum(-(-n // SIZE) for n in LENS)
    work = PagedWork(*map(jnp.asarray, paged_work(tables, LENS, SIZE, size=64)), live=jnp.int32(live))
    assert len(work_sizes(64)) > 1
    outs = [jax.jit(lambda q, p, w, b=b: attend_work(q, k_pages[None], v_pages[None], jnp.int32(0), p, w,
                                                     backend=b))(q, q_pos, work) for b in ("native", "fa")]
    _assert_real_rows_equal(outs[1], outs[0], q_pos, _tolerance(v_pages))


def test_the_kernels_bfloat16_decode_is_as_close_to_float32_as_the_xla_paths(tmp_path: Path) -> None:
    """``benchmarks/kernel_numerics.py`` on the bench's trained tiny model: in bfloat16, the GPU
    decode kernel (Pallas interpret mode here) stays as close to the float32 answer as the XLA
    path does (measured: mean logprob error 0.002-0.004 for both), and both keep float32's greedy
    choices; a kernel fault (a wrong page, scale or mask) would be far off."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "numerics.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_numerics.py"), "--seeds", "1",
                           "--steps", "40", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"] if "backend" in r}
    native, fa = rows["native"], rows["fa"]
    assert 0 < native["mean_abs_logprob_err"] < 0.05 and fa["mean_abs_logprob_err"] < 2 * native["mean_abs_logprob_err"]
    assert native["argmax_agrees_with_float32"] >= 0.95 and fa["argmax_agrees_with_float32"] >= 0.95
