"""Packing variable-length sequences into fixed-shape micro-batches (NumPy only).

Sequences are assigned to micro-batches under a token budget, each micro-batch is padded to a
length from a small fixed set of buckets (so the jitted train step compiles a handful of
shapes, not one per batch), and data-parallel groups are given equal micro-batch counts so that
their collective operations line up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

DEFAULT_BUCKET_BASE = 256
DEFAULT_BUCKET_COUNT = 8


def make_buckets(base: int = DEFAULT_BUCKET_BASE, count: int = DEFAULT_BUCKET_COUNT) -> tuple[int, ...]:
    """``base * 2**k`` for ``k < count``: 256 ... 32768 by default."""
    return tuple(base * 2**k for k in range(count))


DEFAULT_BUCKETS = make_buckets()


def bucket_length(n: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds ``n`` tokens."""
    for b in sorted(buckets):
        if b >= n:
            return int(b)
    raise ValueError(f"{n} tokens exceed the largest bucket ({max(buckets)}); add a larger bucket")


def _split_in_two(items: list[int], size: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Longest first, each into the lighter half: both halves non-empty, neither over the original."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for i in sorted(items, key=lambda i: -size(i)):
        side = 0 if (loads[0], len(halves[0])) <= (loads[1], len(halves[1])) else 1
        halves[side].append(i)
        loads[side] += size(i)
    return halves


def pack_first_fit_decreasing(
    lengths: Sequence[int], token_budget: int, min_micro_batches: int = 1
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most ``token_budget`` tokens each.

    Sequences go longest first; each goes into the micro-batch, among those it fits in, that
    holds the fewest sequences (ties: the one opened first), and opens a new one when none fits.
    Preferring the emptiest bin spreads short sequences, which evens out per-micro-batch
    attention cost without costing fill.

    If that yields fewer than ``min_micro_batches`` bins, the bin with the most tokens among
    those with two or more sequences is split in two (longest first into the lighter half) until
    there are enough; splitting never exceeds the budget. Fewer sequences than
    ``min_micro_batches`` is an error.
    """
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n > token_budget:
            raise ValueError(f"sequence {i} has {n} tokens, more than the token budget of {token_budget}")
    if len(lengths) < min_micro_batches:
        raise ValueError(f"{len(lengths)} sequences cannot fill {min_micro_batches} micro-batches")

    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best = -1
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget and (best < 0 or len(bins[b]) < len(bins[best])):
                best = b
        if best < 0:
            bins.append([])
            loads.append(0)
        bins[best].append(i)
        loads[best] += lengths[i]

    while len(bins) < min_micro_batches:
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: loads[b])
        first, second = _split_in_two(bins[b], lengths.__getitem__)
        bins[b] = first
        loads[b] = sum(lengths[i] for i in first)
        bins.append(second)
        loads.append(sum(lengths[i] for i in second))
    return bins


def equalize_micro_batch_count(
    bins_per_dp_group: Sequence[Sequence[Sequence[int]]], lengths: Sequence[int] | None = None
) -> list[list[list[int]]]:
    """Give every data-parallel group the same number of micro-batches.

    A group short of the maximum splits its largest micro-batch (by tokens when ``lengths`` is
    given, else by sequence count) in two, repeatedly; splitting lowers the padded length of
    both halves, so it costs less than running an extra empty step. Only when no micro-batch has
    two sequences left are empty micro-batches appended; they are all padding with a zero loss
    mask, so they contribute nothing but keep the collectives in step.
    """
    target = max((len(g) for g in bins_per_dp_group), default=0)
    size: Callable[[int], int] = (lambda i: 1) if lengths is None else (lambda i: int(lengths[i]))
    out: list[list[list[int]]] = []
    for group in bins_per_dp_group:
        group = [list(b) for b in group]
        while len(group) < target:
            splittable = [b for b in range(len(group)) if len(group[b]) > 1]
            if not splittable:
                group.append([])
                continue
            b = max(splittable, key=lambda b: sum(size(i) for i in group[b]))
            first, second = _split_in_two(group[b], size)
            group[b] = first
            group.append(second)
        out.append(group)
    return out


def build_packed_batch(
    sequences: Sequence[Mapping[str, np.ndarray]], indices: Sequence[int], pad_to: int
) -> dict[str, np.ndarray]:
    """Concatenate the per-token fields of ``sequences[indices]`` into one row of ``pad_to`` tokens.

    Every field is 1-D and as long as that sequence's ``input_ids``; padding is zeros of the
    field's dtype, so a padded ``loss_mask`` is 0. Adds ``segment_ids`` (1..k for the k packed
    sequences, 0 for padding) for attention masking and ``positions`` (restarting at 0 for each
    sequence) for rotary embeddings.
    """
    if not sequences:
        raise ValueError("build_packed_batch needs at least one sequence to know the fields")
    fields = list(sequences[0])
    chosen = [sequences[i] for i in indices]
    for k, seq in zip(indices, chosen, strict=True):
        if set(seq) != set(fields):
            raise ValueError(f"sequence {k} has fields {sorted(seq)}, expected {sorted(fields)}")
        n = len(seq["input_ids"])
        bad = [f for f in fields if np.ndim(seq[f]) != 1 or len(seq[f]) != n]
        if bad:
            raise ValueError(f"sequence {k}: fields {bad} are not 1-D of length {n}")
    lengths = [len(s["input_ids"]) for s in chosen]
    total = sum(lengths)
    if total > pad_to:
        raise ValueError(f"{total} tokens do not fit in pad_to={pad_to}")

    out = {}
    for f in fields:
        dtype = np.asarray(sequences[0][f]).dtype
        row = np.zeros(pad_to, dtype)
        if chosen:
            row[:total] = np.concatenate([np.asarray(s[f], dtype) for s in chosen])
        out[f] = row
    segment_ids = np.zeros(pad_to, np.int32)
    positions = np.zeros(pad_to, np.int32)
    start = 0
    for k, n in enumerate(lengths, start=1):
        segment_ids[start : start + n] = k
        positions[start : start + n] = np.arange(n)
        start += n
    out["segment_ids"] = segment_ids
    out["positions"] = positions
    return out


def attention_block_pairs(lengths: Sequence[int], row_length: int, block: int) -> np.ndarray:
    """The (query block, key block) pairs that causal attention within segments needs in one
    packed row: the row holds sequences of ``lengths`` back to back, then padding up to
    ``row_length`` (a multiple of ``block``). A query block needs every key block from the one
    where the sequence of its first token starts up to itself. Padding only has to see some
    padding (its output is never used, but must be finite): a block of padding gets its own
    block alone, so a mostly empty row costs one pair per block, not the square of its padding.
    ``int32 [n, 2]``, by query block then key block."""
    if row_length % block:
        raise ValueError(f"row_length={row_length} is not a multiple of block={block}")
    starts = np.cumsum([0, *lengths])  # each sequence's first position; the last is where padding starts
    if starts[-1] > row_length:
        raise ValueError(f"{starts[-1]} tokens do not fit in row_length={row_length}")
    first = np.arange(0, row_length, block)  # each query block's first position
    seq = np.searchsorted(starts, first, side="right") - 1  # the sequence (or the padding) it belongs to
    begin = np.where(first >= starts[-1], np.arange(len(first)), np.minimum(starts[seq], starts[-1]) // block)
    query = np.arange(len(first))
    counts = query - begin + 1
    return np.stack([np.repeat(query, counts),
                     np.concatenate([np.arange(b, q + 1) for b, q in zip(begin, query, strict=True)])],
                    axis=1).astype(np.int32)


def pair_budget(needed: int, blocks: int) -> int:
    """Room for ``needed`` block pairs in a row of ``blocks`` blocks, rounded up on a geometric
    scale (steps of 2 ** 0.25 times ``blocks``) so that few budgets, and so few compiled shapes,
    cover a run; never more than every causal pair."""
    if needed <= blocks:
        return blocks
    steps = int(np.ceil(4 * np.log2(needed / blocks) - 1e-9))
    return int(min(np.ceil(blocks * 2 ** (steps / 4)), blocks * (blocks + 1) // 2))
