"""The KV page allocator: a pool of fixed-size pages, refcounted, and each request's page table.

The paged KV cache (``models.decoder.PagedKVCache``) stores keys and values in pages of
``page_size`` tokens; a request holds the pages its own tokens lie in, in order, and a page read by
several requests (a group's shared prompt) is held once per reader. This module is the host side
of that: which pages are free, who holds which, and where a request's next tokens go. Pure Python,
no JAX, so the scheduler's policy and its tests run without a device.

Page 0 is never handed out: it is the sink that padding rows write to and padding entries of a
page list point at, so a compiled step never needs a branch for "no page". A pool of
``num_pages`` usable pages therefore has ``num_pages + 1`` physical pages; SGLang's
``max_total_num_tokens`` is ``num_pages * page_size``.

Sharing is by whole pages: ``PageTable.fork`` gives a new request the full pages of a prefix and
the tokens of a partly filled last page are the new request's own to write. A table never writes
the pages it forked (``write_slots`` refuses), and the table they came from has filled them already
or fills them in the same step (a group admitted together), so no page is ever copied on write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

SINK_PAGE = 0
"""The physical page padding writes go to and padding page entries name; never allocated."""


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a request asked for; nothing was allocated."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"needed {needed} free KV pages, {free} free")
        self.needed, self.free = needed, free


class PageAllocator:
    """``num_pages`` pages of ``page_size`` tokens (physical pages ``1 .. num_pages``), each with a
    reference count; a page is free when its count is 0. Allocation is all-or-nothing."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages}: a KV pool needs at least one page; raise max_total_tokens")
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: pages hold at least one token")
        self.num_pages, self.page_size = num_pages, page_size
        self._refs = np.zeros((num_pages + 1,), np.int64)
        # A stack: the most recently freed page is handed out first (it is likeliest in cache).
        self._free = list(range(num_pages, 0, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def max_total_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages that ``num_tokens`` tokens from the start of a sequence lie in."""
        return -(-num_tokens // self.page_size)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def alloc(self, n: int) -> list[int]:
        """``n`` free pages, each now held once; ``OutOfPages`` (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._refs[pages] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        """One more holder of each of ``pages`` (all held already)."""
        pages = list(pages)
        for p in pages:
            if not 1 <= p <= self.num_pages or self._refs[p] <= 0:
                raise ValueError(f"page {p} is not held: only a held page can be shared")
        for p in pages:
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        """One holder fewer of each of ``pages``; a page nobody holds is free again."""
        for p in pages:
            if not 1 <= p <= self.num_pages or self._refs[p] <= 0:
                raise ValueError(f"page {p} is released more often than it was held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check(self) -> None:
        """Raise if the free list and the reference counts disagree (a test and debugging aid)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        zero = {int(p) for p in np.flatnonzero(self._refs[1:] == 0) + 1}
        if free != zero:
            raise AssertionError(f"free list {sorted(free)[:8]}.. != unreferenced pages {sorted(zero)[:8]}..")
        if self._refs[SINK_PAGE] != 0 or (self._refs < 0).any():
            raise AssertionError("the sink page is held, or a count went negative")


class PageTable:
    """One request's KV pages: ``pages[i]`` holds its tokens ``i * page_size .. (i + 1) * page_size
    - 1``. ``num_tokens`` is how many of them are written (or about to be); the first ``shared``
    pages were forked from another table and are read-only for this one."""

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.pages: list[int] = []
        self.num_tokens = 0
        self.shared = 0

    @property
    def capacity(self) -> int:
        return len(self.pages) * self.allocator.page_size

    def pages_needed(self, num_tokens: int) -> int:
        """New pages ``reserve(num_tokens)`` would take."""
        return max(0, self.allocator.pages_for(num_tokens) - len(self.pages))

    def reserve(self, num_tokens: int) -> None:
        """Hold pages for the first ``num_tokens`` tokens (all-or-nothing: ``OutOfPages`` and no
        change when the pool is short); ``num_tokens`` never shrinks here (see ``truncate``)."""
        if num_tokens <= self.num_tokens:
            return
        self.pages += self.allocator.alloc(self.pages_needed(num_tokens))
        self.num_tokens = num_tokens

    def truncate(self, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens, releasing the pages past them."""
        if num_tokens >= self.num_tokens:
            return
        keep = self.allocator.pages_for(num_tokens)
        self.allocator.release(self.pages[keep:])
        del self.pages[keep:]
        self.shared = min(self.shared, keep)
        self.num_tokens = num_tokens

    def release(self) -> None:
        """Give back every page (a finished, aborted or retracted request)."""
        self.truncate(0)

    def fork(self, num_tokens: int) -> PageTable:
        """A new table that shares this one's whole pages among its first ``num_tokens`` tokens
        (rounded down to a page): the prompt pages of a group's answers. The new table holds
        ``shared * page_size`` tokens; it writes the rest of a prompt itself."""
        if num_tokens > self.num_tokens:
            raise ValueError(f"cannot share {num_tokens} tokens of a table that holds {self.num_tokens}")
        child = PageTable(self.allocator)
        whole = num_tokens // self.allocator.page_size
        self.allocator.retain(self.pages[:whole])
        child.pages, child.shared = self.pages[:whole], whole
        child.num_tokens = whole * self.allocator.page_size
        return child

    def write_slots(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Physical (page, offset) of tokens ``start .. stop - 1``, where a step writes their keys
        and values: reserved, and none in a shared page."""
        if stop > self.num_tokens or start < 0:
            raise ValueError(f"tokens {start}..{stop} are not reserved (the table holds {self.num_tokens})")
        size = self.allocator.page_size
        if start < self.shared * size:
            raise ValueError(f"token {start} lies in a page forked from another request, which also reads it: "
                             f"shared pages are read-only")
        index = np.arange(start, stop)
        return np.asarray(self.pages, np.int32)[index // size], (index % size).astype(np.int32)


NO_POSITION = 2**30
"""``first`` of a padding work entry: past every position, so all its keys are masked."""


def paged_work(page_lists: Sequence[Sequence[int]], kv_lens: Sequence[int], page_size: int,
               size: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ragged work list (``models.attention.PagedWork``'s ``rows, pages, first``) of a step in
    which row ``i`` attends to its first ``kv_lens[i]`` tokens, held in ``page_lists[i]``: one
    entry per page read, rows in order, padded to ``size`` entries (a bucket, so the compiled
    shapes stay few) with fully masked entries on the last row's sink page."""
    rows, pages, first = [], [], []
    for i, (held, n) in enumerate(zip(page_lists, kv_lens, strict=True)):
        count = -(-n // page_size)
        if count > len(held):
            raise ValueError(f"row {i} attends to {n} tokens but holds {len(held)} pages of {page_size}")
        rows += [i] * count
        pages += list(held[:count])
        first += range(0, count * page_size, page_size)
    size = len(rows) if size is None else size
    if size < len(rows):
        raise ValueError(f"the work list has {len(rows)} entries, more than size={size}")
    n = len(rows)
    out_rows = np.full((size,), max(len(page_lists) - 1, 0), np.int32)
    out_pages, out_first = np.full((size,), SINK_PAGE, np.int32), np.full((size,), NO_POSITION, np.int32)
    out_rows[:n], out_pages[:n], out_first[:n] = rows, pages, first
    return out_rows, out_pages, out_first


def work_size(entries: int, stride: int = 128) -> int:
    """The padded length of a work list of ``entries``: a power of two up to ``stride``, then the
    next multiple of ``stride``. Attention's cost follows the padded length, so the stride bounds
    the waste of a long list (a long tail of 692 entries pads to 768, not 1,024) while the compiled
    shapes stay few: a pool of ``P`` pages read once each needs about ``log2(stride) + P / stride``."""
    if entries <= stride:
        return 1 << max(entries - 1, 0).bit_length()
    return -(-entries // stride) * stride


class PagedBatch(NamedTuple):
    """The host arrays of one paged call (``Decoder.decode_paged``'s arguments): ``ids``,
    ``positions`` (-1 for padding), ``write_pages`` and ``write_offsets`` (the sink for padding),
    each ``[rows, width]``, and the work list ``rows, pages, first``; ``last[i]`` is the column of
    row ``i``'s last token, whose logits sample its next one."""

    ids: np.ndarray
    positions: np.ndarray
    write_pages: np.ndarray
    write_offsets: np.ndarray
    work: tuple[np.ndarray, np.ndarray, np.ndarray]
    last: np.ndarray


def paged_batch(rows: Sequence[tuple[PageTable, Sequence[int], int]], num_rows: int, width: int,
                stride: int = 128) -> PagedBatch:
    """One call's arrays: row ``i`` = ``(table, tokens, start)`` computes ``tokens`` at positions
    ``start ..`` (reserved in ``table``) and attends to every token of its sequence up to the last
    of them. Rows are padded to ``num_rows`` and tokens to ``width`` (buckets chosen by the
    caller), the work list by ``work_size(.., stride)``."""
    if not rows or len(rows) > num_rows:
        raise ValueError(f"a paged call of {num_rows} rows was given {len(rows)}: it needs 1 to {num_rows}")
    shape = (num_rows, width)
    ids, pos = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
    wp, wo = np.full(shape, SINK_PAGE, np.int32), np.zeros(shape, np.int32)
    last = np.zeros((num_rows,), np.int32)
    tables, lens = [], []
    for i, (table, tokens, start) in enumerate(rows):
        n = len(tokens)
        if not 0 < n <= width:
            raise ValueError(f"row {i} has {n} tokens; a row computes 1 to width={width}")
        ids[i, :n], pos[i, :n] = tokens, np.arange(start, start + n)
        wp[i, :n], wo[i, :n] = table.write_slots(start, start + n)
        last[i] = n - 1
        tables.append(table.pages)
        lens.append(start + n)
    page_size = rows[0][0].allocator.page_size
    size = work_size(sum(-(-n // page_size) for n in lens), stride)
    return PagedBatch(ids, pos, wp, wo, paged_work(tables, lens, page_size, size=size), last)
