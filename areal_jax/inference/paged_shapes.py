"""What the paged engine compiles, and compiling it ahead: the fixed set of call shapes a running
engine uses (mixed steps, one per prefill width; decode calls, one per power of two of rows; the
alternating path's first prefill shapes) and ``warmup``, which runs each once on padding so that
nothing compiles mid-run (a compile there stalls every answer for seconds and grows the process).
A mixin of ``PagedEngine``: it reads the engine's config, allocator and jitted steps."""

from __future__ import annotations

from typing import Any

import numpy as np

from areal_jax.inference.engine import _SamplingRows
from areal_jax.inference.paged_batches import MIN_DECODE_ROWS, MIN_WIDTH, MIN_WORK, pow2
from areal_jax.inference.pages import NO_POSITION, SINK_PAGE

__all__ = ["PagedShapes"]


class PagedShapes:
    """The compile-ahead half of ``PagedEngine`` (shapes and warm-up)."""

    cfg: Any
    allocator: Any
    max_seq_len: int
    max_top: int
    mixed_chunk: bool
    compiled_shapes: set[tuple[Any, ...]]
    mixed_fn: Any
    prefill_fn: Any
    decode_fn: Any
    _running: bool
    _lanes: list[Any]
    _state: Any
    _run_step: Any  # PagedEngine's: runs one jitted step on the pool

    @property
    def min_decode_rows(self) -> int:
        return min(MIN_DECODE_ROWS, pow2(self.cfg.num_slots))

    @property
    def row_pages(self) -> int:
        """The most pages one row of a call reads: a full context."""
        return self.allocator.pages_for(self.max_seq_len)

    @property
    def mixed_rows(self) -> int:
        """Decode rows of every mixed step: room for every running request. A mixed step runs
        while prompts are prefilled (a transient); one row count there keeps its shapes to one
        per prefill width (decode calls keep a row count per power of two)."""
        return pow2(self.cfg.num_slots, self.min_decode_rows)

    def prefill_widths(self) -> list[int]:
        """Every padded width a prefill row can have: powers of two from ``MIN_WIDTH`` up to the
        longest take (a chunk, or a whole prompt shorter than the context)."""
        chunk = self.cfg.chunked_prefill_size
        longest = min(self.max_seq_len - 1, self.max_seq_len if chunk == -1 else chunk)
        return [w for w in (MIN_WIDTH << k for k in range(64)) if w <= pow2(longest, MIN_WIDTH)]

    def mixed_prefill_rows(self, width: int) -> int:
        """Prefill rows of a mixed step of ``width``-token rows: the most ``_prefill_rows`` can
        give that width (``max_prefill_batch`` rows, padded at most twice the real tokens or
        256, the call at most ``max_prefill_tokens``, the real tokens at most a chunk)."""
        chunk = self.cfg.chunked_prefill_size
        real = self.cfg.max_prefill_batch * (self.max_seq_len - 1)
        if chunk != -1:
            real = min(real, chunk)
        tokens = min(self.cfg.max_prefill_tokens, max(2 * real, 256))
        return min(pow2(self.cfg.max_prefill_batch), 1 << max(tokens // width, 1).bit_length() - 1)

    def _mixed_shape(self, width: int) -> tuple[Any, ...]:
        rows, prefill_rows = self.mixed_rows, self.mixed_prefill_rows(width)
        return ("mixed", rows, prefill_rows, width, rows * self.row_pages, prefill_rows * self.row_pages)

    def _decode_shape(self, rows: int) -> tuple[Any, ...]:
        return ("decode", rows, self.cfg.decode_steps, rows * self.row_pages)

    def step_shapes(self) -> list[tuple[Any, ...]]:
        """The shapes ``warmup`` compiles, every one a running engine calls: mixed steps
        ``("mixed", rows, prefill rows, width, work, prefill work)``, one per prefill width
        (``prefill_widths``), and decode calls ``("decode", rows, steps, work)``, one per power of
        two of rows. Work lists have a fixed length per shape (``_fixed_work``): the pages read
        are chosen on device. On the alternating path (``mixed_chunk`` False) prefill calls
        ``("prefill", rows, width, work)`` of one and two short prompts are compiled first, and
        its other prefill shapes when first used (``compiled_shapes``)."""
        if self.mixed_chunk:
            first = [self._mixed_shape(w) for w in self.prefill_widths()]
        else:
            first = [("prefill", 1, MIN_WIDTH, MIN_WORK), ("prefill", 2, MIN_WIDTH, MIN_WORK)]
        rows = [r for r in (self.min_decode_rows << k for k in range(64)) if r <= self.mixed_rows]
        return [*first, *(self._decode_shape(r) for r in rows)]

    def _warm_call(self, shape: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """(jitted step, host arguments after the pool, static arguments) of a call of ``shape``
        on padding: every write goes to the sink page, every work entry is masked."""
        def work(n: int, live: bool = True) -> tuple[np.ndarray, ...]:
            padding = (np.zeros((n,), np.int32), np.zeros((n,), np.int32), np.full((n,), NO_POSITION, np.int32))
            return (*padding, np.int32(0)) if live else padding

        kind, rows, width, size = shape[:4]
        steps = {"num_steps": self.cfg.decode_steps, "max_top": self.max_top}
        p, z, n = _SamplingRows(rows), np.zeros((rows,), np.int32), self.cfg.decode_steps
        sampling = (p.temperature, p.top_p, p.top_k, p.seed, p.stream, z, p.top_n, z, p.stop_ids, np.bool_(False))
        if kind == "mixed":  # (mixed, rows, prefill rows, width, work, prefill work)
            ids = np.zeros(shape[2:4], np.int32)
            return self.mixed_fn, (z, z - 1, np.full((rows, n), SINK_PAGE, np.int32), np.zeros((rows, n), np.int32),
                                   work(shape[4]), ids, ids - 1, ids + SINK_PAGE, ids, work(shape[5]),
                                   *sampling), steps
        zeros, sink = np.zeros((rows, width), np.int32), np.full((rows, width), SINK_PAGE, np.int32)
        if kind == "prefill":  # (prefill, rows, width, work)
            return self.prefill_fn, (zeros, zeros - 1, sink, zeros, work(size, False)), {}
        return self.decode_fn, (z, z, sink, zeros, work(size), *sampling), steps  # (decode, rows, steps, work)

    def warmup(self, stop: Any = None) -> int:
        """Compile ``step_shapes`` by running each once on padding (``_warm_call``), one after
        another; returns how many. Call before ``start()``. (Compiling them in worker threads at
        once was no faster on 2 busy cores and kept about 270 MiB more resident: each thread's
        allocator arena.)"""
        if self._running:
            raise RuntimeError("warmup() runs before start(): it steps the pool")
        lane = self._lanes[0]
        shapes = self.step_shapes()
        for done, shape in enumerate(shapes):
            if stop is not None and stop.is_set():
                return done
            fn, args, static = self._warm_call(shape)
            out = self._run_step(fn, self._state, lane.cache, *args, **static)
            lane.cache = out if fn is self.prefill_fn else out[0]
            self.compiled_shapes.add(shape)
        return len(shapes)
