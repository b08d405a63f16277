"""The paged engine: continuous batching over one pool of KV pages (``EngineConfig.kv_cache = "paged"``).

``Engine``'s API and request bookkeeping (streams, aborts, pauses, weight swaps, per-token
version stamps) over a different core. The KV cache is one pool of ``page_size``-token pages
(``models.decoder.PagedKVCache``); each running request holds a page table
(``inference.pages``) and the scheduler (``inference.schedule``) admits waiting requests by free
pages under ``max_running_requests``, lets a group's answers share their prompt's pages, keeps
the written pages of requests that left in a prefix cache for later requests with the same
prefix (``inference.prefix_cache``; dropped whenever the served weights change, see ``_state``)
and retracts the requests with the fewest output tokens when a decode call needs pages the pool
does not have (they go back to the queue's front with every token, and prefill again when pages
free).

One loop steps the pool. Each round admits what fits, then makes one device call:

- a mixed step (``paged_steps.mixed_step``) while some prompt has tokens to prefill: up to
  ``chunked_prefill_size`` tokens to prefill, packed from as many requests as they come from in
  blocks of a fixed width (each block a row reading only its own pages), and the first decode
  token of every running answer run as one flat batch, then the answers decode up to
  ``decode_steps - 1`` more tokens in a decode call of the answers' rows right after it
  (``_run_mixed``: one worker-thread call, the decode loop compiled once for both kinds of call).
  A long prompt so never stalls the answers in flight (SGLang's mixed chunk). Prefill writes
  every token but a request's last, which its first decode step computes and samples from: in
  the same call when the chunk ends its prefill (every token's keys and values are written
  before any row attends).
- else a decode call that advances every request whose tokens but the last are written by up to
  ``decode_steps`` tokens, each row reading only its own pages through a ragged work list
  (``Decoder.decode_paged_layers``), so a step costs the tokens live, not rows x the longest.

``mixed_chunk = False`` keeps the alternating path: a prefill call per chunk, then a decode call.

A request that shares pages another request writes (a group admitted together, answers sent again
with their tokens after an abort, a long prompt still being prefilled in chunks) joins the call
that writes them, behind its writer's blocks, or waits for a later one.

Shapes: ``warmup`` compiles every shape a running engine calls, so nothing compiles mid-run (a
compile there stalls every answer for seconds and grows the process), or, with ``compile_threads``,
worker threads compile them from ``start()`` while it serves (``paged_compiles``). A work list, whose length
follows the pages the requests hold, has a fixed length per call shape (every row a full
context) and is read on device only up to the smallest of ``models.paged.work_sizes`` that holds
its live entries: the pages read cost what they are without being part of the shape. A mixed
step has a row for every running request and its prefill blocks padded to one of a few counts
(``PagedShapes.block_counts``): one shape per count. A decode call pads its rows to a
power of two: one shape per power of two up to ``max_running_requests``. The host arrays of each
call are built in ``paged_batches``, the compiled steps live in ``paged_steps``, the shapes and
their warm-up in ``paged_shapes``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.engine import Engine, _Lane, _Seq
from areal_jax.inference.paged_batches import PagedBatches
from areal_jax.inference.paged_shapes import PagedShapes
from areal_jax.inference.paged_steps import decode_step, mixed_step, prefill_step
from areal_jax.inference.pages import SINK_PAGE, PageAllocator
from areal_jax.inference.pool_size import pool_tokens
from areal_jax.inference.schedule import Request, Scheduler
from areal_jax.models.decoder import K_PAGE_AXES, V_PAGE_AXES, Decoder, PagedKVCache
from areal_jax.models.paged_kernels import choose_attention_backend
from sharding import activate, logical_to_sharding

__all__ = ["PagedEngine"]

log = logging.getLogger(__name__)

@dataclass(eq=False)
class _Request(Request):
    """The scheduler's request, with the engine's request beside it."""

    seq: _Seq | None = None

    def written_tokens(self) -> int:
        """``seq.computed``: what it may leave in the prefix cache; none while pages it shares are
        still to be written by another request."""
        seq = self.seq
        return seq.computed if seq is not None and seq.source is None else 0


class PagedEngine(PagedShapes, PagedBatches, Engine):
    """``Engine`` over a paged KV pool (see the module docstring)."""

    mixed_chunk: bool = True
    """Prefill chunks run in mixed steps beside the decode tokens of every running answer; False:
    the alternating path (a prefill call, then a decode call of ``decode_steps``). Set it on an
    engine before it starts."""

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        self.pool_tokens = pool_tokens(cfg, model)
        self.allocator = PageAllocator(self.pool_tokens // cfg.page_size, cfg.page_size)
        self.attention_backend = choose_attention_backend(model.config, cfg.attention_backend, page_size=cfg.page_size,
                                                          devices=1 if mesh is None else mesh.size)
        """``native`` or ``fa``: what every compiled step is given as its static ``attention_backend``."""
        super().__init__(model, cfg, eos_token_ids=eos_token_ids, mesh=mesh, version=version)
        self.scheduler = self._new_scheduler()
        # the slot engine's names, so what wraps a step (a test's failing device) wraps these
        self.prefill_fn = jax.jit(partial(prefill_step, self._graphdef), donate_argnums=(1,),
                                  static_argnames=("attention_backend",))
        self.decode_fn = jax.jit(partial(decode_step, self._graphdef), donate_argnums=(1,),
                                 static_argnames=("num_steps", "max_top", "attention_backend"))
        self.mixed_fn = jax.jit(partial(mixed_step, self._graphdef), donate_argnums=(1,),
                                static_argnames=("num_steps", "max_top", "attention_backend"))
        self.compiled_shapes: set[tuple] = set()
        """Every (step, rows, width, work) shape called so far: the compilations it cost."""
        self.stats.update({"retractions": 0, "cached_prompt_tokens": 0, "mixed_calls": 0, "mixed_seconds": 0.0,
                           "prefill_tokens": 0, "decode_rows": 0, "decode_padded_rows": 0, "work_entries": 0,
                           "work_padded_entries": 0})

    @property
    def _state(self) -> Any:
        return self.__dict__["_served_state"]

    @_state.setter
    def _state(self, state: Any) -> None:
        """Every change of the served weights passes here (a swap, ``set_state``, a handover):
        the keys and values computed so far, cached or in running requests' pages, are the old
        weights', so the scheduler drops its prefix cache and stops sharing them."""
        self.__dict__["_served_state"] = state
        if "scheduler" in self.__dict__:
            self.scheduler.weights_changed()

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.allocator, max_running_requests=self.cfg.num_slots, context_length=self.max_seq_len,
                         headroom=self.cfg.decode_steps, share_prompts=self.cfg.share_prompts)

    def _resolve_lanes(self) -> int:
        return 1  # one pool, one loop: ``lanes`` is the slot path's knob

    # -- properties --

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) if hasattr(self, "scheduler") else 0

    @property
    def max_total_num_tokens(self) -> int:
        """The pool's tokens (SGLang's ``max_total_num_tokens``)."""
        return self.allocator.max_total_tokens

    def server_info(self) -> dict[str, Any]:
        """The KV pool and limits under SGLang's /get_server_info names."""
        return {**super().server_info(), "max_total_num_tokens": self.allocator.max_total_tokens,
                "page_size": self.cfg.page_size, "max_total_tokens": self.cfg.max_total_tokens,
                "mem_fraction_static": self.cfg.mem_fraction_static, "kv_cache": "paged",
                "attention_backend": self.attention_backend}

    # -- the pool --

    def _fresh_cache(self) -> tuple[Any, None]:
        """A zero pool (the lane's ``cache``); the paged engine keeps no device slot state."""
        with activate(self.mesh):
            dtype = self.cfg.cache_dtype and np.dtype(self.cfg.cache_dtype)
            pool = self.model.init_paged_cache(self.allocator.num_pages, self.cfg.page_size, dtype)
            if self.mesh is not None:
                shard = lambda x, axes: jax.device_put(x, logical_to_sharding(axes, self.mesh))
                pool = PagedKVCache(shard(pool.k, K_PAGE_AXES), shard(pool.v, V_PAGE_AXES))
        return self._committed(pool), None

    def _replicated(self, x: np.ndarray) -> Any:
        """A host array placed as the compiled steps want it: on the mesh, replicated."""
        if self.mesh is None:
            return x
        return jax.device_put(x, logical_to_sharding((None,) * x.ndim, self.mesh))

    # -- queue --

    def _enqueue(self, seq: _Seq) -> None:
        sp = seq.req.sampling
        req = _Request(str(seq.stream_id), tuple(seq.req.input_ids), sp.max_new_tokens, output=seq.out_ids, seq=seq)
        self.scheduler.submit(req)  # raises for a prompt the pool cannot hold
        seq.sched = req

    def _release(self, seq: _Seq) -> None:
        req = seq.sched
        if req is not None and (req.table is not None or req in self.scheduler.waiting):
            self.scheduler.finish(req)
        self._unseat(seq)

    def _unseat(self, seq: _Seq) -> None:
        """``seq`` holds no seat and no KV any more (finished, or back in the queue). The
        requests that share pages it has written no longer wait for it: those pages stay theirs
        (they hold them), so a group's leader that finishes first costs its followers nothing."""
        if seq.sched is not None and seq.source is None and seq.computed:
            for other in self.scheduler.running:
                if other.seq is not None and other.seq.source is seq.sched and seq.computed >= other.seq.shared:
                    other.seq.source = None
        if seq.lane is not None:
            seq.lane.slots[seq.slot] = None
            seq.lane = seq.slot = None
        seq.computed = seq.shared = 0
        seq.source = None

    async def _pause(self, mode: str) -> None:
        if mode != "retract":
            await super()._pause(mode)
            return
        if self._paused is None:
            self._paused_at = time.perf_counter()
        self._paused = mode
        async with self._all_lanes():
            for req in self.scheduler.retract_all():
                self._unseat(req.seq)

    def _can_step(self, lane: _Lane) -> bool:
        return self._paused is None and bool(self.scheduler.running or self.scheduler.waiting)

    async def flush_cache(self) -> bool:
        async with self._all_lanes():
            if self.num_running or self.num_waiting:
                return False
            self.scheduler.drop_cache()
            lane = self._lanes[0]
            lane.cache = await asyncio.to_thread(self._run_zero, lane.cache)
            return True

    # -- the loop --

    def _recover(self, lane: _Lane, e: Exception) -> None:
        """After a failed round (``Engine._loop``): fail every request (one pool, one loop) and
        start again on a fresh pool and scheduler."""
        log.exception("paged engine step failed")
        self._abort_where(lambda s: True, f"engine error: {e!r}", status_code=500)
        self.scheduler.drop_cache()  # the new pool is zero: nothing cached is in it
        lane.cache = None  # free the old pool before the new one
        lane.cache, _ = self._fresh_cache()
        self.scheduler = self._new_scheduler()
        self.allocator.check()

    def _admit_waiting(self, lane: _Lane) -> None:
        self.scheduler.version = self._version
        for adm in self.scheduler.admit():
            seq = adm.request.seq
            seq.computed = seq.shared = adm.shared_tokens
            if adm.request.retractions == 0:  # its first admission
                seq.cached = adm.shared_tokens
            seq.source = adm.source if adm.shared_tokens else None
            seat = lane.slots.index(None)
            lane.slots[seat], seq.lane, seq.slot = seq, lane, seat
            self.stats["prompt_tokens"] += seq.length
            self.stats["shared_prompt_tokens"] += adm.shared_tokens
            if adm.source is None:
                self.stats["cached_prompt_tokens"] += adm.shared_tokens

    def _ready(self, seq: _Seq) -> bool | None:
        """Whether the pages ``seq`` shares are written: True; False while their writer has yet to
        write them; None when their writer left before it did (``seq`` must prefill again)."""
        src = seq.source
        if src is None:
            return True
        writer = src.seq
        if src.table is None or writer is None or writer.finish_reason is not None:
            return None
        up = self._ready(writer)
        if up is None:
            return None
        if up and writer.computed >= seq.shared:
            seq.source = None
            return True
        return False

    async def _round(self, lane: _Lane) -> None:
        """One scheduling round: admit, then one mixed call (a prefill chunk and the decode tokens
        of every running answer) or a decode call; on the alternating path a prefill call, then a
        decode call."""
        self._admit_waiting(lane)
        if not self.scheduler.running and self.scheduler.waiting:
            # the head does not fit an empty pool (a resumed answer grown past it): end it there
            seq = self.scheduler.waiting[0].seq
            self._finish(seq, {"type": "length", "length": len(seq.out_ids)})
            return
        live = []  # ready, or waiting for pages another request writes (``_prefill_rows`` decides)
        for req in list(self.scheduler.running):
            if self._ready(req.seq) is None:  # its shared pages will never be written: start it over
                self.scheduler.retract(req)
                self._unseat(req.seq)
            else:
                live.append(req.seq)
        prefill = [s for s in live if s.computed < s.length - 1]
        if prefill and not self.mixed_chunk:
            await self._prefill_paged(lane, prefill)
            if self._paused is not None:  # a pause waits for this round: do not make it wait for a decode too
                return
            prefill = []
        self._grow(self.cfg.decode_steps)
        prefill = [s for s in prefill if s.sched.table is not None]  # not retracted for the pages
        if prefill:
            await self._mixed_paged(lane, prefill)
            return
        decode = self._decodable({})
        if decode:
            await self._decode_paged(lane, decode)

    def _decodable(self, planned: dict[int, int]) -> list[_Seq]:
        """The running requests whose tokens but the last are written, or are once a call has
        written ``planned`` (``id(seq)``: its tokens written by then): a request sharing pages
        another writes in that call reads them in it (every token's keys and values are written
        before any row attends)."""
        out = []
        for r in self.scheduler.running:
            seq = r.seq
            written = planned.get(id(seq), seq.computed)
            if seq.finish_reason is not None or written != seq.length - 1:
                continue
            if seq.source is None or planned.get(id(seq.source.seq), -1) >= seq.shared:
                out.append(seq)
        return out

    def _wrote(self, rows: list[tuple[_Seq, int, int]], readers: list[_Seq]) -> None:
        """A call ran that wrote ``rows`` (``_prefill_rows``) and read them for ``readers``: a
        reader whose shared pages it wrote no longer waits for their writer (they are written,
        whatever becomes of it)."""
        planned = {id(seq): start + take for seq, start, take in rows}
        for seq in readers:
            if seq.source is not None and planned.get(id(seq.source.seq), -1) >= seq.shared:
                seq.source = None

    def _grow(self, tokens: int) -> None:
        """Pages for ``tokens`` more tokens of every running request, retracting (or, alone,
        cutting) what the pool cannot hold."""
        growth = self.scheduler.grow(tokens)
        for req in growth.retracted:
            self.stats["retractions"] += 1
            self._unseat(req.seq)
        for req in growth.cut:  # alone and still short of pages: the pool cannot hold more of it
            self._finish(req.seq, {"type": "length", "length": len(req.seq.out_ids)})

    async def _prefill_paged(self, lane: _Lane, seqs: list[_Seq]) -> None:
        """The alternating path's prefill call: the next chunk of ``seqs`` (``_prefill_rows``)."""
        rows, (ids, pos, wp, wo, work) = self._prefill_rows(seqs)
        lane.cache = await self._timed("prefill_seconds", self._run_step, self._prefill_shape(*ids.shape),
                                       self.prefill_fn, self._state, lane.cache, ids, pos, wp, wo, work,
                                       attention_backend=self.attention_backend)
        self.stats["prefill_calls"] += 1
        self._wrote(rows, [seq for seq, _, _ in rows])
        self._prefilled(rows)

    async def _decode_paged(self, lane: _Lane, seqs: list[_Seq]) -> None:
        n = self.cfg.decode_steps
        tokens, positions, step, count, wp, wo, p, work = self._decode_rows(seqs, n)
        early = np.bool_(bool(self.scheduler.waiting) and self.cfg.end_chunk_at_finish)
        version = self._version
        out = await self._timed(
            "decode_seconds", self._run_decode, lane, self._decode_shape(len(tokens)), tokens, positions, wp, wo,
            work, p.temperature, p.top_p, p.top_k, p.seed, p.stream, step, p.top_n, count, p.stop_ids, early)
        self.stats["decode_calls"] += 1
        self._take_tokens(seqs, count, version, *out)

    async def _mixed_paged(self, lane: _Lane, prefill: list[_Seq]) -> None:
        """One mixed call: the next chunk of ``prefill`` beside up to ``decode_steps`` tokens of
        each running request whose tokens but the last are written once the chunk is (the first
        in the chunk's forward pass): a request whose prefill the chunk ends, or whose shared
        pages it writes, samples its first token in the same call."""
        n = self.cfg.decode_steps
        rows, chunk = self._prefill_rows(prefill)
        decode = self._decodable({id(seq): start + take for seq, start, take in rows})
        # the fixed shapes ``warmup`` compiled (``_mixed_shape``): every running row, the chunk's
        # blocks padded to one of ``block_counts``, work lists at their fixed lengths
        tokens, positions, step, count, wp, wo, p, work = self._decode_rows(decode, n, num_rows=self.mixed_rows)
        early = np.bool_(bool(self.scheduler.waiting) and self.cfg.end_chunk_at_finish)
        version = self._version
        out = await self._timed("mixed_seconds", self._run_mixed, lane, self._mixed_shape(*chunk[0].shape), tokens,
                                positions, wp, wo, work, *chunk,
                                p.temperature, p.top_p, p.top_k, p.seed, p.stream, step, p.top_n, count, p.stop_ids,
                                early, live_rows=len(decode))
        self.stats["mixed_calls"] += 1
        self._wrote(rows, [seq for seq, _, _ in rows] + decode)
        self._prefilled(rows)
        self._take_tokens(decode, count, version, *out)

    def _run_step(self, shape: tuple[Any, ...], fn: Any, state: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one compiled paged step on host arrays ``args`` (placed replicated on a mesh),
        once no background compile of its ``shape`` (the caller's, as ``PagedShapes`` spells it)
        is in hand (``PagedShapes._claim``); ``shape`` joins ``compiled_shapes``."""
        self._claim(shape)
        self.compiled_shapes.add(shape)
        with activate(self.mesh):
            return fn(state, cache, *jax.tree.map(self._replicated, args), **kwargs)

    def _run_mixed(self, lane: _Lane, shape: tuple[Any, ...], tokens: np.ndarray, positions: np.ndarray,
                   wp: np.ndarray, wo: np.ndarray, work: tuple[np.ndarray, ...], ids: np.ndarray,
                   prefill_positions: np.ndarray,
                   prefill_pages: np.ndarray, prefill_offsets: np.ndarray, prefill_work: tuple[np.ndarray, ...],
                   temperature: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, seed: np.ndarray,
                   stream: np.ndarray, step: np.ndarray, top_n: np.ndarray, remaining: np.ndarray,
                   stop_ids: np.ndarray, early: np.bool_, live_rows: int) -> tuple[np.ndarray, ...]:
        """The mixed step (the chunk and each answer's first token), then, unless no answer has
        a token left (or one stopped and ``early``), a decode call of its first ``live_rows``
        rows (the answers; the rest is padding) for the rest: ``decode_step``'s outputs over
        both, for those rows. The decode call has the rows of a plain decode call (a power of
        two, compiled at warm-up), not every running row: while prompts keep arriving most rounds
        are mixed, and their decode steps then cost the answers live."""
        sampling = (temperature, top_p, top_k, seed, stream)
        lane.cache, out = self._run_step(shape, self.mixed_fn, self._state, lane.cache, tokens, positions, wp, wo,
                                         work, ids, prefill_positions, prefill_pages, prefill_offsets, prefill_work,
                                         *sampling, step, top_n, remaining, stop_ids, early,
                                         num_steps=self.cfg.decode_steps, max_top=self.max_top,
                                         attention_backend=self.attention_backend)
        main, values, top_ids, rest, ended = (np.asarray(x) for x in jax.device_get(out))
        if not rest.any() or (early and ended):
            return main, values, top_ids, 1
        # the decode call's arrays: the answers' rows (work entries are in row order, and each row
        # reads at most ``row_pages``), one token on, the write columns shifted (a sink column last)
        k = self.fit_rows(live_rows)
        cut = lambda a: a[:k]
        shift = lambda a, v: np.concatenate([a[:k, 1:], np.full((k, 1), v, a.dtype)], axis=1)
        work = (*(w[:k * self.row_pages] for w in work[:3]), work[3])
        more = self._run_decode(lane, self._decode_shape(k), main[0, 0, :k].astype(np.int32), cut(positions) + 1,
                                shift(wp, SINK_PAGE), shift(wo, 0), work, *map(cut, sampling), cut(step) + 1,
                                cut(top_n), cut(rest).astype(np.int32), cut(stop_ids), early)
        return (np.concatenate([main[:, :, :k], more[0]], axis=1), np.concatenate([values[:, :k], more[1]]),
                np.concatenate([top_ids[:, :k], more[2]]), 1 + int(more[3]))

    def _run_decode(self, lane: _Lane, shape: tuple[Any, ...], *args: Any) -> tuple[np.ndarray, ...]:
        lane.cache, out = self._run_step(shape, self.decode_fn, self._state, lane.cache, *args,
                                         num_steps=self.cfg.decode_steps, max_top=self.max_top,
                                         attention_backend=self.attention_backend)
        return tuple(np.asarray(x) for x in jax.device_get(out))
