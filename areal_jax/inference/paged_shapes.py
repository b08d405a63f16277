"""What the paged engine compiles, and compiling it ahead: the fixed set of call shapes a running
engine uses (mixed steps, one per count of prefill blocks; decode calls, one per power of two of
rows; on the alternating path prefill calls, one per count of blocks) and ``warmup``, which runs
each once on padding so that nothing compiles mid-run (a compile there stalls every answer for
seconds and grows the process), and ``compile_in_background``, which compiles the shapes not
compiled yet in worker threads after ``start()`` while the engine serves (``paged_compiles``). A
mixin of ``PagedEngine``: it reads the engine's config, allocator and jitted steps."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import jax
import numpy as np

from areal_jax.inference.engine import _SamplingRows
from areal_jax.inference.paged_batches import LONG_BLOCK, LONG_TAKE, MIN_DECODE_ROWS, PREFILL_BLOCK, pow2
from areal_jax.inference.paged_compiles import BackgroundCompiles
from areal_jax.inference.pages import NO_POSITION, SINK_PAGE
from sharding import activate

__all__ = ["PagedShapes"]


COMPILE_THREADS_ENV = "AREAL_JAX_COMPILE_THREADS"
"""The default of ``areal-jax serve --compile-threads`` (and of a run's in-process engine) where set."""


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
    mesh: Any
    attention_backend: str
    _run_step: Any  # PagedEngine's: runs one jitted step on the pool
    _replicated: Any  # PagedEngine's: a host array placed as the steps want it
    background_compiles: BackgroundCompiles | None = None
    """The compiles ``compile_in_background`` started (the last ``start()``'s), or None."""

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

    def longest_take(self) -> int:
        """The most tokens of one request a call prefills: a chunk, or a whole prompt shorter
        than the context."""
        chunk = self.cfg.chunked_prefill_size
        return min(self.max_seq_len - 1, self.max_seq_len if chunk == -1 else chunk)

    def block_widths(self) -> list[int]:
        """The widths of prefill blocks: ``PREFILL_BLOCK``, and ``LONG_BLOCK`` where a request
        can have ``LONG_TAKE`` or more tokens to prefill (``_prefill_rows``; a chunk of 512 does)."""
        return [PREFILL_BLOCK] + ([LONG_BLOCK] if self.longest_take() >= LONG_TAKE else [])

    def block_counts(self, width: int) -> list[int]:
        """The block counts a prefill of ``width``-token blocks pads to: powers of four from 8
        below the most a call holds (a chunk's tokens in blocks, at most ``max_prefill_tokens``),
        then that most. A few shapes: a group's prompt pads to 8 blocks, not to the chunk. Long
        blocks fill the call (the long chunk at its head does): that count alone."""
        chunk = self.cfg.chunked_prefill_size
        budget = self.max_seq_len if chunk == -1 else chunk
        room = max(1, min(pow2(-(-budget // width)), self.cfg.max_prefill_tokens // width))
        if width != PREFILL_BLOCK:
            return [room]
        counts, n = [], 8
        while n < room:
            counts.append(n)
            n *= 4
        return [*counts, room]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every ``(blocks, width)`` a prefill chunk can have (``block_widths``, ``block_counts``)."""
        return [(n, w) for w in self.block_widths() for n in self.block_counts(w)]

    def _mixed_shape(self, blocks: int, width: int) -> tuple[Any, ...]:
        rows = self.mixed_rows
        return ("mixed", rows, blocks, width, rows * self.row_pages, blocks * self.row_pages)

    def _decode_shape(self, rows: int) -> tuple[Any, ...]:
        return ("decode", rows, self.cfg.decode_steps, rows * self.row_pages)

    def _prefill_shape(self, blocks: int, width: int) -> tuple[Any, ...]:
        return ("prefill", blocks, width, blocks * self.row_pages)

    def step_shapes(self) -> list[tuple[Any, ...]]:
        """The shapes ``warmup`` compiles, every one a running engine calls: mixed steps
        ``("mixed", rows, prefill blocks, width, work, prefill work)``, one per
        ``prefill_shapes``, and decode calls ``("decode", rows, steps, work)``, one per power of
        two of rows. Work lists have a fixed length per shape (``_fixed_work``): the pages read
        are chosen on device. On the alternating path (``mixed_chunk`` False) prefill calls
        ``("prefill", blocks, width, work)`` take the mixed steps' place."""
        if self.mixed_chunk:
            first = [self._mixed_shape(n, w) for n, w in self.prefill_shapes()]
        else:
            first = [self._prefill_shape(n, w) for n, w in self.prefill_shapes()]
        rows = [r for r in (self.min_decode_rows << k for k in range(64)) if r <= self.mixed_rows]
        return [*first, *(self._decode_shape(r) for r in rows)]

    async def start(self) -> None:
        """Start the loop; with ``cfg.compile_threads``, and shapes not compiled yet, compile them
        in the background meanwhile (``compile_in_background``)."""
        if not self._running and self.cfg.compile_threads:
            self.background_compiles = self.compile_in_background(self.cfg.compile_threads) or self.background_compiles
        await super().start()

    async def stop(self) -> None:
        """``Engine.stop``, then no more background compiles (waiting for those in hand)."""
        await super().stop()
        if self.background_compiles is not None:
            await asyncio.to_thread(self.background_compiles.close)

    def compile_order(self) -> list[tuple[Any, ...]]:
        """``step_shapes`` in the order ``compile_in_background`` compiles them: first the widest
        mixed (or prefill) call and the decode call of the most rows, which every call fits
        (``_fitting`` pads a call up to them meanwhile), then the rest, the two kinds alternating,
        each from its smallest (the shapes of the first prompts, then of bursts)."""
        shapes = self.step_shapes()
        first = [s for s in shapes if s[0] != "decode"]
        decode = [s for s in shapes if s[0] == "decode"]
        widest = first[-1:] + decode[-1:]
        first, decode = first[:-1], decode[:-1]
        order = [s for pair in zip(first, decode, strict=False) for s in pair]
        n = min(len(first), len(decode))
        return [*widest, *order, *first[n:], *decode[n:]]

    def _fitting(self, shapes: list[tuple[Any, ...]]) -> int:
        """Which of ``shapes`` (a call's own shape, then the larger ones its arrays can be padded
        to) the call takes: its own, unless background compiles are under way
        (``compile_in_background``); then the first compiled already, else the first a worker
        compiles now (the call waits for it in ``_run_step``), else its own (the call compiles
        it). So while the shapes compile, a call pads up to one compiled or being compiled
        rather than start yet another compile: the first requests wait for at most the widest
        shapes' compiles, not for every shape they meet one after another. Padding rows and
        blocks compute nothing that is kept (position -1, the sink page)."""
        compiles = self.background_compiles
        if compiles is None or not compiles.pending:
            return 0
        for i, shape in enumerate(shapes):
            if shape in self.compiled_shapes or compiles.compiled(shape):
                return i
        return next((i for i, shape in enumerate(shapes) if compiles.running(shape)), 0)

    def fit_blocks(self, blocks: int, width: int) -> int:
        """The block count a prefill chunk of ``blocks`` blocks of ``width`` tokens pads to: the
        smallest of ``block_counts`` that holds them, or a larger one (``_fitting``)."""
        counts = [n for n in self.block_counts(width) if n >= blocks]
        if self.mixed_chunk:
            shapes = [self._mixed_shape(n, width) for n in counts]
        else:
            shapes = [self._prefill_shape(n, width) for n in counts]
        return counts[self._fitting(shapes)]

    def fit_rows(self, rows: int) -> int:
        """The rows a decode call of ``rows`` live rows pads to: the smallest power of two that
        holds them (at least ``min_decode_rows``), or a larger one up to ``mixed_rows``
        (``_fitting``)."""
        least = pow2(rows, self.min_decode_rows)
        counts = [least] + [r for r in (self.min_decode_rows << k for k in range(64)) if least < r <= self.mixed_rows]
        return counts[self._fitting([self._decode_shape(r) for r in counts])]

    def compile_in_background(self, threads: int) -> BackgroundCompiles | None:
        """Compile the ``compile_order`` shapes neither called nor compiled ahead before, in
        ``threads`` worker threads (``BackgroundCompiles``); ``_run_step`` claims each shape before
        its call. None when nothing is left to compile."""
        before = self.background_compiles
        done = set(self.compiled_shapes)
        if before is not None:
            done |= {s for s, f in before.futures.items() if f.done() and not f.cancelled() and f.exception() is None}
        shapes = [s for s in self.compile_order() if s not in done]
        if not shapes or threads < 1:
            return None
        # the pool and weights as shapes and shardings: the loop donates the pool while a worker
        # lowers, and a weight swap replaces the state with arrays of the same specs
        spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        state, cache = spec(self._state), spec(self._lanes[0].cache)

        def compile_one(shape: tuple[Any, ...]) -> None:
            fn, args, static = self._warm_call(shape)
            with activate(self.mesh):
                fn.lower(state, cache, *jax.tree.map(self._replicated, args), **static).compile()

        # the widest shapes, which every call fits, at the thread's priority (the first requests
        # wait for them); the rest at a lower one: calls fit the widest meanwhile
        widest = set(self.compile_order()[:2])
        return BackgroundCompiles(sorted(shapes, key=lambda s: s not in widest), compile_one, threads,
                                  urgent=sum(s in widest for s in shapes))

    def _claim(self, shape: tuple[Any, ...]) -> None:
        """Before a call of ``shape`` (``_run_step``'s): wait for its compile in the background,
        if one is running (``BackgroundCompiles.claim``)."""
        if self.background_compiles is not None:
            self.background_compiles.claim(shape)

    @staticmethod
    def default_compile_threads() -> int:
        """Worker threads of ``compile_in_background`` when none are given: ``$AREAL_JAX_COMPILE_THREADS``
        where set (the test suite sets 0: its servers meet a shape or two each), else one per two usable
        cores, at most 8. (On a busy 2-core CPU two compiles at once took longer than the same
        two one after another, and a demo's evaluation before RL took 25 s with 2 threads against
        14 s with 1: the serving and the trainer need the other core.)"""
        given = os.environ.get(COMPILE_THREADS_ENV)
        if given is not None and given.strip():
            try:
                threads = int(given)
            except ValueError:
                threads = -1
            if threads < 0:
                raise ValueError(f"{COMPILE_THREADS_ENV}={given!r}: give a whole number of threads, 0 or more "
                                 "(0: each step shape compiles at its first call)")
            return threads
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(8, cores // 2))

    def _warm_call(self, shape: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """(jitted step, host arguments after the pool, static arguments) of a call of ``shape``
        on padding: every write goes to the sink page, every work entry is masked."""
        def work(n: int) -> tuple[np.ndarray, ...]:
            return np.zeros((n,), np.int32), np.zeros((n,), np.int32), np.full((n,), NO_POSITION, np.int32), np.int32(0)

        kind, rows, width, size = shape[:4]
        backend = {"attention_backend": self.attention_backend}
        steps = {"num_steps": self.cfg.decode_steps, "max_top": self.max_top, **backend}
        p, z, n = _SamplingRows(rows), np.zeros((rows,), np.int32), self.cfg.decode_steps
        sampling = (p.temperature, p.top_p, p.top_k, p.seed, p.stream, z, p.top_n, z, p.stop_ids, np.bool_(False))
        if kind == "mixed":  # (mixed, rows, prefill rows, width, work, prefill work)
            ids = np.zeros(shape[2:4], np.int32)
            return self.mixed_fn, (z, z - 1, np.full((rows, n), SINK_PAGE, np.int32), np.zeros((rows, n), np.int32),
                                   work(shape[4]), ids, ids - 1, ids + SINK_PAGE, ids, work(shape[5]),
                                   *sampling), steps
        zeros, sink = np.zeros((rows, width), np.int32), np.full((rows, width), SINK_PAGE, np.int32)
        if kind == "prefill":  # (prefill, rows, width, work)
            return self.prefill_fn, (zeros, zeros - 1, sink, zeros, work(size)), backend
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
            out = self._run_step(shape, fn, self._state, lane.cache, *args, **static)
            lane.cache = out if fn is self.prefill_fn else out[0]
        return len(shapes)
