"""Block-sparse attention over packed rows against full attention within segments: the block pairs
the host plans, and the attention they drive (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.data.packing import attention_block_pairs, build_packed_batch, pair_budget
from areal_jax.models.attention import attend_packed, attend_packed_pairs


def _needed(lengths: list[int], row: int, block: int) -> set[tuple[int, int]]:
    """Block pairs holding a query and a key of one sequence, the key not after the query, and
    each block holding padding with itself (brute force)."""
    seg = np.full(row, -1)
    seg[:sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    qi, kj = np.nonzero(np.tril((seg[:, None] == seg[None, :]) & (seg[:, None] > 0)))
    pads = {(i // block, i // block) for i in np.flatnonzero(seg < 0).tolist()}
    return set(zip((qi // block).tolist(), (kj // block).tolist(), strict=True)) | pads


@pytest.mark.parametrize("seed", range(30))
def test_planned_pairs_are_exactly_the_needed_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    block = int(rng.choice([8, 16, 32]))
    row = block * int(rng.integers(1, 10))
    lengths: list[int] = []
    while sum(lengths) < row and rng.random() > 0.05:
        lengths.append(int(rng.integers(1, min(3 * block, row - sum(lengths)) + 1)))
    pairs = attention_block_pairs(lengths, row, block)
    assert set(map(tuple, pairs.tolist())) == _needed(lengths, row, block)
    assert len(pairs) == len(_needed(lengths, row, block))  # no pair twice


def test_pair_budget_rounds_up_on_few_sizes() -> None:
    budgets = {pair_budget(n, 16) for n in range(1, 137)}
    assert all(pair_budget(n, 16) >= n for n in range(1, 137))
    assert len(budgets) <= 14 and max(budgets) == 16 * 17 // 2


def _packed(rng: np.random.Generator, rows: int, row: int, block: int, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    segs, pairs = [], []
    for _ in range(rows):
        lengths: list[int] = []
        while True:
            n = int(rng.integers(1, max_len + 1))
            if sum(lengths) + n > row - int(rng.integers(0, block)):
                break
            lengths.append(n)
        seqs = [{"input_ids": np.zeros(n, np.int32)} for n in lengths]
        segs.append(build_packed_batch(seqs, range(len(lengths)), row)["segment_ids"])
        pairs.append(attention_block_pairs(lengths, row, block))
    budget = pair_budget(max(len(p) for p in pairs), row // block) + 3  # room to spare: padded pairs
    padded = np.zeros((rows, budget, 2), np.int32)
    padded[..., 1] = row // block - 1  # unused: query block 0 against the last key block
    for i, p in enumerate(pairs):
        padded[i, :len(p)] = p
    return np.stack(segs), padded


@pytest.mark.parametrize("block,max_len", [(16, 40), (32, 100), (64, 20)])
def test_block_sparse_attention_equals_full_attention(block: int, max_len: int) -> None:
    rng = np.random.default_rng(block)
    rows, row, heads, kv_heads, d = 2, 8 * block, 4, 2, 8
    seg, pairs = _packed(rng, rows, row, block, max_len)
    q = jnp.asarray(rng.normal(size=(rows, row, heads, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, row, kv_heads, d)), jnp.float32) for _ in range(2))
    real = (seg != 0)[..., None, None]  # what padding queries attend to is no path's business
    w = jnp.asarray(rng.normal(size=(rows, row, heads, d)) * real, jnp.float32)  # a loss on every real output

    def full(q, k, v):
        return (attend_packed(q, k, v, jnp.asarray(seg)) * w).sum()

    def sparse(q, k, v):
        return (attend_packed_pairs(q, k, v, jnp.asarray(seg), jnp.asarray(pairs), block) * w).sum()

    out = jax.jit(attend_packed_pairs, static_argnums=5)(q, k, v, jnp.asarray(seg), jnp.asarray(pairs), block)
    np.testing.assert_allclose(out * real, jax.jit(attend_packed)(q, k, v, jnp.asarray(seg)) * real, atol=2e-6)
    assert np.isfinite(np.asarray(out)).all()
    for a, b in zip(jax.jit(jax.grad(full, (0, 1, 2)))(q, k, v), jax.jit(jax.grad(sparse, (0, 1, 2)))(q, k, v),
                    strict=True):
        np.testing.assert_allclose(a, b, atol=5e-6)
