"""Paged KV decoding: the ragged gather path against a NumPy transcription of attention over each
row's own pages, and the paged decoder against the full forward and the per-slot cache, for ragged
lengths, page boundaries, pages scattered over the pool, and prompt pages shared by a group."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_jax.inference.pages import PageAllocator, PageTable, paged_work
from areal_jax.models import load_pretrained
from areal_jax.models.attention import PagedWork, attend_paged

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _reference(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, q_pos: np.ndarray,
               page_lists: list[list[int]]) -> np.ndarray:
    """Softmax attention of each query over its row's keys at positions <= its own, the keys read
    page by page from the pool into one contiguous sequence (NumPy, float64)."""
    b, t, nh, d = q.shape
    kvh = k_pages.shape[1]
    out = np.zeros(q.shape)
    for i in range(b):
        keys = np.concatenate([k_pages[p].transpose(2, 0, 1) for p in page_lists[i]])  # [s, kvh, d]
        values = np.concatenate([v_pages[p].transpose(1, 0, 2) for p in page_lists[i]])
        for j in range(t):
            visible = q_pos[i, j] + 1
            if visible == 0:  # a padding query: no reference value
                continue
            for h in range(nh):
                kh = h // (nh // kvh)
                s = keys[:visible, kh] @ q[i, j, h] / np.sqrt(d)
                w = np.exp(s - s.max())
                out[i, j, h] = (w / w.sum()) @ values[:visible, kh]
    return out


@pytest.mark.parametrize("t", [1, 3])
def test_attend_paged_matches_attention_over_each_rows_own_pages(t: int) -> None:
    rng = np.random.default_rng(0)
    size, pool_pages, nh, kvh, d = 4, 24, 4, 2, 8
    # Ragged: one token, exactly one page, one past a page boundary, a long row; pages scattered.
    lens = [1, 4, 5, 15]
    perm = rng.permutation(np.arange(1, pool_pages + 1)).tolist()
    page_lists = []
    for n in lens:
        count = -(-n // size)
        page_lists.append(perm[:count])
        del perm[:count]
    k_pages = rng.normal(size=(pool_pages + 1, kvh, d, size)).astype(np.float32)
    v_pages = rng.normal(size=(pool_pages + 1, kvh, size, d)).astype(np.float32)
    q = rng.normal(size=(len(lens), t, nh, d)).astype(np.float32)
    # The last t tokens of each row are queries (a prefill chunk when t > 1); a row shorter than
    # t has padding queries at position -1, whose output is unused.
    q_pos = np.array([[n - t + j if n - t + j >= 0 else -1 for j in range(t)] for n in lens], np.int32)
    work = PagedWork(*map(jnp.asarray, paged_work(page_lists, lens, size, size=16)))
    got = np.asarray(jax.jit(attend_paged)(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages),
                                           jnp.asarray(q_pos), work))
    assert np.isfinite(got).all()
    want = _reference(q, k_pages, v_pages, q_pos, page_lists)
    real = q_pos >= 0
    np.testing.assert_allclose(got[real], want[real], atol=2e-5)


_ATTEND = jax.jit(attend_paged)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lens=st.lists(st.integers(1, 28), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_attend_paged_over_any_ragged_lengths_and_page_layouts(lens: list[int], seed: int) -> None:
    """Any lengths (page boundaries included) of up to 4 rows, pages drawn at random from the pool,
    rows padded to 4 and the work list to 32 entries (one compiled shape): equal to the reference."""
    rng = np.random.default_rng(seed)
    size, nh, kvh, d, rows = 4, 4, 2, 8, 4
    perm = rng.permutation(np.arange(1, 29)).tolist()
    page_lists = []
    for n in lens:
        count = -(-n // size)
        page_lists.append(perm[:count])
        del perm[:count]
    k_pages = rng.normal(size=(29, kvh, d, size)).astype(np.float32)
    v_pages = rng.normal(size=(29, kvh, size, d)).astype(np.float32)
    q = rng.normal(size=(rows, 1, nh, d)).astype(np.float32)
    q_pos = np.array([[n - 1] for n in lens] + [[-1]] * (rows - len(lens)), np.int32)
    work = PagedWork(*map(jnp.asarray, paged_work(page_lists, lens, size, size=32)))
    got = np.asarray(_ATTEND(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(q_pos), work))
    assert np.isfinite(got).all()
    want = _reference(q[:len(lens)], k_pages, v_pages, q_pos[:len(lens)], page_lists)
    np.testing.assert_allclose(got[:len(lens)], want, atol=2e-5)


def test_rows_without_pages_stay_finite_and_leave_other_rows_alone() -> None:
    """Batch padding rows read no page: their output is finite (zeros). Were it NaN, the decoder
    would write NaN keys and values into the sink page, which the masked padding entries of real
    rows read with weight 0, and 0 * NaN is NaN (``test_paged_loop`` caught exactly that)."""
    rng = np.random.default_rng(3)
    kvh, d, size = 2, 8, 4
    k_pages = rng.normal(size=(6, kvh, d, size)).astype(np.float32)
    v_pages = rng.normal(size=(6, kvh, size, d)).astype(np.float32)
    q = rng.normal(size=(3, 1, 4, d)).astype(np.float32)
    q_pos = np.array([[5], [-1], [-1]], np.int32)
    work = PagedWork(*map(jnp.asarray, paged_work([[2, 4]], [6], size, size=4)))  # rows 1, 2: no entries
    got = np.asarray(attend_paged(jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(q_pos),
                                  work))
    assert np.isfinite(got).all() and not got[1:].any()
    np.testing.assert_allclose(got[:1], _reference(q[:1], k_pages, v_pages, q_pos[:1], [[2, 4]]), atol=2e-5)


def test_paged_work_pads_with_masked_entries_and_checks_its_input() -> None:
    rows, pages, first = paged_work([[3, 7], [5]], [5, 2], page_size=4, size=5)
    assert rows.tolist() == [0, 0, 1, 1, 1] and pages.tolist() == [3, 7, 5, 0, 0]
    assert first.tolist()[:3] == [0, 4, 0] and min(first.tolist()[3:]) > 10**8
    with pytest.raises(ValueError, match="holds 1 pages"):
        paged_work([[3]], [5], page_size=4)
    with pytest.raises(ValueError, match="size=2"):
        paged_work([[3, 7], [5]], [5, 2], page_size=4, size=2)


@jax.jit
def _step(model, ids, positions, cache, write_pages, write_offsets, work):
    return model.decode_paged(ids, positions, cache, write_pages=write_pages, write_offsets=write_offsets,
                              work=PagedWork(*work))


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _run(model, cache, tables: list[PageTable], ids: list[list[int]], starts: list[int], width: int):
    """One paged call: row i writes and reads ``ids[i]`` at positions ``starts[i] ..`` (rows padded to
    ``width`` tokens, padding on the sink); returns logits ``[b, width, vocab]`` and the pool."""
    b = len(tables)
    tok = np.zeros((b, width), np.int32)
    pos = np.full((b, width), -1, np.int32)
    wp, wo = np.zeros((b, width), np.int32), np.zeros((b, width), np.int32)
    for i, (t, row, s) in enumerate(zip(tables, ids, starts, strict=True)):
        t.reserve(s + len(row))
        tok[i, :len(row)], pos[i, :len(row)] = row, np.arange(s, s + len(row))
        wp[i, :len(row)], wo[i, :len(row)] = t.write_slots(s, s + len(row))
    lens = [s + len(row) for row, s in zip(ids, starts, strict=True)]
    size = tables[0].allocator.page_size
    work = paged_work([t.pages for t in tables], lens, size, size=_bucket(sum(-(-n // size) for n in lens)))
    logits, cache = _step(model, jnp.asarray(tok), jnp.asarray(pos), cache, jnp.asarray(wp), jnp.asarray(wo),
                          tuple(map(jnp.asarray, work)))
    return np.asarray(logits), cache


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_paged_decode_matches_the_full_forward_for_ragged_rows(family: str) -> None:
    """Prompts of 3, 8 (two whole pages) and 13 tokens prefilled in one padded call, then token
    steps that cross page boundaries, each row's pages scattered over the pool: every position's
    logits equal the full forward's (and so the per-slot cache's, tested against the same)."""
    model = load_pretrained(FIXTURES / f"hf_{family}")
    rng = np.random.default_rng(1)
    total = 22
    ids = rng.integers(0, 96, (3, total)).astype(np.int32)
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids)))
    pool = PageAllocator(num_pages=32, page_size=4)
    scatter = pool.alloc(9)  # hold every other page, so the rows' pages are not contiguous
    pool.release(scatter[::2])
    cache = model.init_paged_cache(pool.num_pages, pool.page_size)
    tables = [PageTable(pool) for _ in range(3)]
    prompts = [3, 8, 13]
    logits, cache = _run(model, cache, tables, [ids[i, :n].tolist() for i, n in enumerate(prompts)], [0, 0, 0], 16)
    for i, n in enumerate(prompts):
        np.testing.assert_allclose(logits[i, :n], full[i, :n], atol=1e-4, err_msg=f"prefill row {i}")
    assert any(b - a != 1 for a, b in zip(tables[2].pages, tables[2].pages[1:], strict=False))
    for step in range(total - max(prompts)):
        at = [n + step for n in prompts]
        logits, cache = _run(model, cache, tables, [[int(ids[i, a])] for i, a in enumerate(at)], at, 1)
        for i, a in enumerate(at):
            np.testing.assert_allclose(logits[i, 0], full[i, a], atol=1e-4, err_msg=f"row {i} position {a}")
    for t in tables:
        t.release()
    pool.release(scatter[1::2])
    assert pool.used_pages == 0


def test_group_answers_read_one_prefill_of_their_prompt() -> None:
    """A 10-token prompt is prefilled once; three answers fork its two whole pages, each writes the
    prompt's last two tokens and its own answer into pages of its own, and decodes: every answer's
    logits equal the full forward of prompt + that answer, while the pool holds the shared pages once."""
    model = load_pretrained(FIXTURES / "hf_qwen2")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 96, 10).tolist()
    answers = rng.integers(0, 96, (3, 6)).tolist()
    full = np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray([prompt + a for a in answers])))
    pool = PageAllocator(num_pages=16, page_size=4)
    cache = model.init_paged_cache(pool.num_pages, pool.page_size)
    owner = PageTable(pool)
    logits, cache = _run(model, cache, [owner], [prompt], [0], 16)
    np.testing.assert_allclose(logits[0, :10], full[0, :10], atol=1e-4)
    group = [owner.fork(10) for _ in answers]
    owner.release()
    assert [pool.refcount(p) for p in group[0].pages] == [3, 3]
    # The rest of the prompt (its partial page) and the first answer token, per answer.
    logits, cache = _run(model, cache, group, [prompt[8:] + a[:1] for a in answers], [8, 8, 8], 4)
    for i in range(3):
        np.testing.assert_allclose(logits[i, :3], full[i, 8:11], atol=1e-4, err_msg=f"answer {i}")
    assert pool.used_pages == 2 + 3  # the prompt's whole pages once, one page of its own per answer
    for step in range(1, 6):
        at = 10 + step
        logits, cache = _run(model, cache, group, [[a[step]] for a in answers], [at] * 3, 1)
        for i in range(3):
            np.testing.assert_allclose(logits[i, 0], full[i, at], atol=1e-4, err_msg=f"answer {i} at {at}")
    for t in group:
        t.release()
    assert pool.used_pages == 0


@pytest.mark.parametrize("half_steps", [True, False])
def test_a_fixed_length_work_list_reads_its_live_entries_in_one_compiled_step(half_steps: bool) -> None:
    """A work list with a live count (the engine's, at a fixed length per call shape) is read on
    device up to the smallest ``work_sizes`` length that holds it: rows whose pages add up to 3,
    40, 70 and 100 entries (under, at and past the sizes 32, 64, 96, 128; without the half steps
    32, 64, 128) each equal the NumPy reference, all through one compiled function (its cache
    holds one entry). Both ladders: the CPU's default has no half steps, an accelerator's has."""
    from areal_jax.models.paged import attend_work, default_half_steps, work_sizes

    rng = np.random.default_rng(5)
    size, nh, kvh, d, rows, cap = 4, 4, 2, 8, 8, 128
    assert work_sizes(cap, half_steps=half_steps) == ((32, 64, 96, 128) if half_steps else (32, 64, 128))
    assert work_sizes(cap) == work_sizes(cap, half_steps=default_half_steps())
    k_pages = rng.normal(size=(1, 129, kvh, d, size)).astype(np.float32)  # one layer of 128 pages + the sink
    v_pages = rng.normal(size=(1, 129, kvh, size, d)).astype(np.float32)
    step = jax.jit(lambda q, pos, work: attend_work(q, jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.int32(0),
                                                    pos, work, half_steps=half_steps))
    for total in (3, 40, 70, 100):
        per_row = [total // rows + (i < total % rows) for i in range(rows)]
        lens = [max(n, 0) * size - int(rng.integers(0, size)) if n else 0 for n in per_row]
        live = [i for i, n in enumerate(lens) if n > 0]
        pages = rng.permutation(np.arange(1, 129)).tolist()
        page_lists = [[pages.pop() for _ in range(-(-n // size))] for n in lens]
        q = rng.normal(size=(rows, 1, nh, d)).astype(np.float32)
        q_pos = np.array([[n - 1] for n in lens], np.int32)
        work = paged_work(page_lists, lens, size, size=cap)
        assert int(np.count_nonzero(work[2] != 2**30)) == total
        got = np.asarray(step(jnp.asarray(q), jnp.asarray(q_pos),
                              PagedWork(*map(jnp.asarray, work), live=jnp.int32(total))))
        want = _reference(q[live], k_pages[0], v_pages[0], q_pos[live], [page_lists[i] for i in live])
        np.testing.assert_allclose(got[live], want, atol=2e-5)
    assert step._cache_size() == 1
