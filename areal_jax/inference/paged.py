"""The paged engine: continuous batching over one pool of KV pages (``EngineConfig.kv_cache = "paged"``).

``Engine``'s API and request bookkeeping (streams, aborts, pauses, weight swaps, per-token
version stamps) over a different core. The KV cache is one pool of ``page_size``-token pages
(``models.decoder.PagedKVCache``); each running request holds a page table
(``inference.pages``) and the scheduler (``inference.schedule``) admits waiting requests by free
pages under ``max_running_requests``, lets a group's answers share their prompt's pages and
retracts the requests with the fewest output tokens when a decode call needs pages the pool does
not have (they go back to the queue's front with every token, and prefill again when pages free).

One loop steps the pool. Each round admits what fits, then runs at most two device calls:

- a prefill call that writes keys and values of up to ``chunked_prefill_size`` tokens over the
  admitted requests (a long prompt takes several rounds, one chunk each, while the running
  answers keep decoding between them). Prefill samples nothing: it writes every token but a
  request's last, which its first decode step computes and samples from.
- a decode call that advances every request whose tokens but the last are written by up to
  ``decode_steps`` tokens, each row reading only its own pages through a ragged work list
  (``Decoder.decode_paged_layers``), so a step costs the tokens live, not rows x the longest.

A request that shares pages another request writes in the same round (a group admitted together,
or a long prompt still being prefilled in chunks) waits until that one has written them. Shapes:
rows, prefill width and work-list length are each padded to a power of two, so the number of
compiled shapes grows with the logarithm of the batch and the pool, and ``warmup`` compiles the
few the first requests need (the rest compile when first used).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.engine import Engine, _Lane, _SamplingRows, _Seq
from areal_jax.inference.paged_steps import decode_step, mixed_step, prefill_step
from areal_jax.inference.pages import NO_POSITION, SINK_PAGE, PageAllocator, paged_work
from areal_jax.inference.schedule import Request, Scheduler, kv_pool_tokens
from areal_jax.models.decoder import K_PAGE_AXES, V_PAGE_AXES, Decoder, PagedKVCache, kv_head_replicas
from sharding import activate, logical_to_sharding

__all__ = ["PagedEngine", "pool_tokens"]

log = logging.getLogger(__name__)

MIN_WIDTH = 16
"""Narrowest padded prefill row (tokens)."""
MIN_WORK = 32
"""Shortest padded work list (pages read in one call): below it a call costs about the same."""
MIN_DECODE_ROWS = 8
"""Fewest padded rows of a decode call: fewer cost about the same, and each count is a shape."""
PREFILL_BLOCK = 64
"""Prefill tokens per query block of a mixed step (fewer when ``chunked_prefill_size`` is): a
block reads only the pages up to its last token, and a chunk pads to whole blocks."""
DEFAULT_DEVICE_FRACTION = 0.85
DEFAULT_HOST_FRACTION = 0.25


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


def work_bucket(n: int, least: int = MIN_WORK) -> int:
    """The padded length of a work list of ``n`` entries: the smallest of ``2**k`` and
    ``3 * 2**(k - 1)`` that holds it (at least ``least``). Attention costs the padded length, so
    the half steps keep the padding under a third (a long tail of 691 entries pads to 768, not
    1,024) for twice the shapes of powers of two alone."""
    p = pow2(n, least)
    return p * 3 // 4 if p >= 4 * least and n <= p * 3 // 4 else p


def kv_bytes_per_token(model: Decoder, dtype: Any = None) -> int:
    """Bytes one token's keys and values take in every layer of the pool."""
    cfg = model.config
    heads = cfg.num_key_value_heads * kv_head_replicas(cfg.num_key_value_heads)
    itemsize = np.dtype(dtype if dtype is not None else cfg.jnp_dtype).itemsize
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * itemsize


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory (``/proc/meminfo``; sysconf where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def pool_tokens(cfg: EngineConfig, model: Decoder) -> int:
    """The KV pool's size in tokens (SGLang's ``max_total_num_tokens``) for ``cfg``.

    ``max_total_tokens`` alone sets it. Otherwise it comes from memory (``schedule.kv_pool_tokens``):
    on a device that reports its memory, weights and pool may take ``mem_fraction_static``
    (default 0.85) of it; on a CPU, which reports none, the pool may take that share (default
    0.25) of the host's available memory. Either way it never exceeds ``num_slots * max_seq_len``
    (every running request at full context: more could never be used) nor ``max_total_tokens``."""
    page = cfg.page_size
    per_token = kv_bytes_per_token(model, cfg.cache_dtype)
    most = -(-cfg.num_slots * cfg.max_seq_len // page) * page
    if cfg.max_total_tokens is not None and cfg.mem_fraction_static is None:
        return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=cfg.max_total_tokens)
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats (CPU) says so in several ways
        stats = None
    cap = most if cfg.max_total_tokens is None else min(most, cfg.max_total_tokens)
    if stats and "bytes_limit" in stats:
        fraction = cfg.mem_fraction_static or DEFAULT_DEVICE_FRACTION
        total = int(stats["bytes_limit"])
        free = total - int(stats.get("bytes_in_use", 0))
        return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=cap,
                              mem_fraction_static=fraction, device_bytes=total, free_bytes=free)
    fraction = cfg.mem_fraction_static or DEFAULT_HOST_FRACTION
    _, available = _host_memory()
    tokens = min(cap, int(available * fraction) // per_token)
    return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=max(tokens, page))


@dataclass(eq=False)
class _Request(Request):
    """The scheduler's request, with the engine's request beside it."""

    seq: _Seq | None = None


class PagedEngine(Engine):
    """``Engine`` over a paged KV pool (see the module docstring)."""

    mixed_chunk: bool = True
    """Prefill chunks run in mixed steps beside one decode token of every running answer; False:
    the alternating path (a prefill call, then a decode call of ``decode_steps``). Set it on an
    engine before it starts."""

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        self.pool_tokens = pool_tokens(cfg, model)
        self.allocator = PageAllocator(self.pool_tokens // cfg.page_size, cfg.page_size)
        super().__init__(model, cfg, eos_token_ids=eos_token_ids, mesh=mesh, version=version)
        self.scheduler = self._new_scheduler()
        # the slot engine's names, so what wraps a step (a test's failing device) wraps these
        self.prefill_fn = jax.jit(partial(prefill_step, self._graphdef), donate_argnums=(1,))
        self.decode_fn = jax.jit(partial(decode_step, self._graphdef), donate_argnums=(1,),
                                 static_argnames=("num_steps", "max_top"))
        self.mixed_fn = jax.jit(partial(mixed_step, self._graphdef), donate_argnums=(1,), static_argnames=("max_top",))
        chunk = cfg.chunked_prefill_size
        self.prefill_block = PREFILL_BLOCK if chunk == -1 else min(PREFILL_BLOCK, pow2(chunk))
        self.compiled_shapes: set[tuple] = set()
        """Every (step, rows, width, work) shape called so far: the compilations it cost."""
        self.stats.update({"retractions": 0, "mixed_calls": 0, "mixed_seconds": 0.0, "prefill_tokens": 0,
                           "decode_rows": 0, "decode_padded_rows": 0, "work_entries": 0, "work_padded_entries": 0})

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
                "mem_fraction_static": self.cfg.mem_fraction_static, "kv_cache": "paged"}

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
        """``seq`` holds no seat and no KV any more (finished, or back in the queue)."""
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
            lane = self._lanes[0]
            lane.cache = await asyncio.to_thread(self._run_zero, lane.cache)
            return True

    # -- the loop --

    def _recover(self, lane: _Lane, e: Exception) -> None:
        """After a failed round (``Engine._loop``): fail every request (one pool, one loop) and
        start again on a fresh pool and scheduler."""
        log.exception("paged engine step failed")
        self._abort_where(lambda s: True, f"engine error: {e!r}", status_code=500)
        lane.cache = None  # free the old pool before the new one
        lane.cache, _ = self._fresh_cache()
        self.scheduler = self._new_scheduler()
        self.allocator.check()

    def _admit_waiting(self, lane: _Lane) -> None:
        for adm in self.scheduler.admit():
            seq = adm.request.seq
            seq.computed = seq.shared = adm.shared_tokens
            seq.source = adm.source if adm.shared_tokens else None
            seat = lane.slots.index(None)
            lane.slots[seat], seq.lane, seq.slot = seq, lane, seat
            self.stats["prompt_tokens"] += seq.length
            self.stats["shared_prompt_tokens"] += adm.shared_tokens

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
        """One scheduling round: admit, then one mixed call (a prefill chunk and one token of every
        running answer) or a decode call; on the alternating path a prefill call, then a decode."""
        self._admit_waiting(lane)
        if not self.scheduler.running and self.scheduler.waiting:
            # the head does not fit an empty pool (a resumed answer grown past it): end it there
            seq = self.scheduler.waiting[0].seq
            self._finish(seq, {"type": "length", "length": len(seq.out_ids)})
            return
        ready = []
        for req in list(self.scheduler.running):
            state = self._ready(req.seq)
            if state is None:  # its shared pages will never be written: start it over
                self.scheduler.retract(req)
                self._unseat(req.seq)
            elif state:
                ready.append(req.seq)
        prefill = [s for s in ready if s.computed < s.length - 1]
        if prefill and not self.mixed_chunk:
            await self._prefill_paged(lane, prefill)
            if self._paused is not None:  # a pause waits for this round: do not make it wait for a decode too
                return
            prefill = []
        if prefill:  # a mixed step decodes one token per answer: pages for that one only
            self._grow(1)
            prefill = [s for s in prefill if s.sched is not None and s.sched.table is not None]
        if not prefill:
            self._grow(self.cfg.decode_steps)
        decode = [r.seq for r in self.scheduler.running
                  if r.seq.source is None and r.seq.computed == r.seq.length - 1 and r.seq.finish_reason is None]
        if prefill:
            await self._mixed_paged(lane, prefill, decode)
        elif decode:
            await self._decode_paged(lane, decode)

    def _grow(self, tokens: int) -> None:
        """Pages for ``tokens`` more tokens of every running request, retracting (or, alone,
        cutting) what the pool cannot hold."""
        growth = self.scheduler.grow(tokens)
        for req in growth.retracted:
            self.stats["retractions"] += 1
            self._unseat(req.seq)
        for req in growth.cut:  # alone and still short of pages: the pool cannot hold more of it
            self._finish(req.seq, {"type": "length", "length": len(req.seq.out_ids)})

    def _work(self, tables: list[list[int]], lens: list[int]) -> tuple[np.ndarray, ...]:
        size = self.allocator.page_size
        entries = sum(-(-n // size) for n in lens)
        padded = work_bucket(entries)
        self.stats["work_entries"] += entries
        self.stats["work_padded_entries"] += padded
        return paged_work(tables, lens, size, size=padded)

    async def _prefill_paged(self, lane: _Lane, seqs: list[_Seq]) -> None:
        """Write the keys and values of the next tokens of ``seqs`` (all but each one's last), up
        to ``chunked_prefill_size`` tokens in all, oldest first."""
        chunk = self.cfg.chunked_prefill_size
        budget = self.max_seq_len if chunk == -1 else chunk
        rows: list[tuple[_Seq, int, int]] = []
        widest = real = 0
        for seq in seqs:
            take = min(seq.length - 1 - seq.computed, budget)
            if take <= 0:
                break
            # rows pad to the widest: a row joins only while the call computes at most twice its
            # real tokens (or is small anyway) and at most max_prefill_tokens
            padded = pow2(len(rows) + 1) * pow2(max(widest, take), MIN_WIDTH)
            if rows and (padded > self.cfg.max_prefill_tokens or padded > max(2 * (real + take), 256)):
                break
            rows.append((seq, seq.computed, take))
            widest, real = max(widest, take), real + take
            budget -= take
            if len(rows) == self.cfg.max_prefill_batch:
                break
        num_rows, width = pow2(len(rows)), pow2(max(t for _, _, t in rows), MIN_WIDTH)
        ids, pos = np.zeros((num_rows, width), np.int32), np.full((num_rows, width), -1, np.int32)
        wp, wo = np.full((num_rows, width), SINK_PAGE, np.int32), np.zeros((num_rows, width), np.int32)
        tables, lens = [], []
        for i, (seq, start, take) in enumerate(rows):
            ids[i, :take] = (seq.req.input_ids + seq.out_ids)[start:start + take]
            pos[i, :take] = np.arange(start, start + take)
            wp[i, :take], wo[i, :take] = seq.sched.table.write_slots(start, start + take)
            tables.append(seq.sched.table.pages)
            lens.append(start + take)
        work = self._work(tables, lens)
        self.compiled_shapes.add(("prefill", num_rows, width, len(work[0])))
        self.stats["prefill_padded_tokens"] += num_rows * width
        self.stats["prefill_tokens"] += sum(t for _, _, t in rows)
        lane.cache = await self._timed("prefill_seconds", self._run_paged, self.prefill_fn, self._state,
                                       lane.cache, ids, pos, wp, wo, work)
        self.stats["prefill_calls"] += 1
        for seq, start, take in rows:
            if seq.finish_reason is None and seq.computed == start:  # not aborted meanwhile
                seq.computed = start + take
                # a chunk: a call that wrote part of a request's tokens, the rest left for later ones
                self.stats["prefill_chunks"] += seq.computed < seq.length - 1

    def _decode_rows(self, seqs: list[_Seq], n: int) -> tuple[Any, ...]:
        """The host arrays of up to ``n`` decode tokens of each of ``seqs`` (rows padded to a
        power of two): tokens, positions, PRNG steps, token counts, write pages and offsets
        ``[rows, n]``, sampling rows and the work list."""
        num_rows = pow2(len(seqs), self.min_decode_rows)
        tokens, positions = np.zeros((num_rows,), np.int32), np.full((num_rows,), -1, np.int32)
        step, count = np.zeros((num_rows,), np.int32), np.zeros((num_rows,), np.int32)
        wp, wo = np.full((num_rows, n), SINK_PAGE, np.int32), np.zeros((num_rows, n), np.int32)
        params = _SamplingRows(num_rows)
        tables, lens = [], []
        for i, seq in enumerate(seqs):
            length = seq.length
            tokens[i] = seq.out_ids[-1] if seq.out_ids else seq.req.input_ids[-1]
            positions[i], step[i] = length - 1, len(seq.out_ids)
            params.fill(i, seq, self, sampled_here=False)
            c = count[i] = min(n, int(params.remaining[i]))
            wp[i, :c], wo[i, :c] = seq.sched.table.write_slots(length - 1, length - 1 + c)
            tables.append(seq.sched.table.pages)
            lens.append(length - 1 + c)
        work = self._work(tables, lens)
        self.stats["decode_rows"] += len(seqs)
        self.stats["decode_padded_rows"] += num_rows
        return tokens, positions, step, count, wp, wo, params, work

    async def _decode_paged(self, lane: _Lane, seqs: list[_Seq]) -> None:
        n = self.cfg.decode_steps
        tokens, positions, step, count, wp, wo, p, work = self._decode_rows(seqs, n)
        self.compiled_shapes.add(("decode", len(tokens), n, len(work[0])))
        early = np.bool_(bool(self.scheduler.waiting) and self.cfg.end_chunk_at_finish)
        version = self._version
        out = await self._timed(
            "decode_seconds", self._run_decode, lane, tokens, positions, wp, wo, work, p.temperature, p.top_p,
            p.top_k, p.seed, p.stream, step, p.top_n, count, p.stop_ids, early)
        self.stats["decode_calls"] += 1
        self._take_tokens(seqs, count, version, *out)

    def _take_tokens(self, seqs: list[_Seq], count: np.ndarray, version: int, main: np.ndarray,
                     top_values: np.ndarray, top_ids: np.ndarray, steps: Any) -> None:
        """Append the tokens a call sampled (``main [2, steps, rows]``: ids and logprobs) to
        ``seqs``, stamped ``version``; a request aborted or retracted meanwhile takes none."""
        steps = int(steps)
        self.stats["decode_steps"] += steps
        toks, logprobs = main[0].astype(np.int64).tolist(), main[1].tolist()
        for i, seq in enumerate(seqs):
            if seq.finish_reason is not None or seq.sched.table is None:  # aborted meanwhile
                continue
            for j in range(min(steps, int(count[i]))):
                self.stats["decode_tokens"] += 1
                seq.computed += 1
                if self._append(seq, toks[j][i], logprobs[j][i], version, top_values[j, i], top_ids[j, i]):
                    break
            self._notify(seq)

    def _prefill_blocks(self, seqs: list[_Seq]) -> tuple[list[tuple[_Seq, int, int]], tuple[np.ndarray, ...]]:
        """The prefill half of a mixed step: the next tokens of ``seqs`` (all but each one's last),
        up to ``chunked_prefill_size`` in all and ``max_prefill_batch`` requests, oldest first, cut
        into blocks of ``prefill_block`` tokens (blocks padded to a power of two). Returns the
        rows ``(seq, start, take)`` and ids, positions, write pages and offsets ``[blocks,
        block]`` and the work list (each block reads its request's pages up to its last token)."""
        chunk, width = self.cfg.chunked_prefill_size, self.prefill_block
        budget = self.max_seq_len if chunk == -1 else chunk
        rows, blocks = [], []
        for seq in seqs[:self.cfg.max_prefill_batch]:
            take = min(seq.length - 1 - seq.computed, budget)
            if take <= 0:
                break
            rows.append((seq, seq.computed, take))
            budget -= take
            blocks += [(seq, b, min(b + width, seq.computed + take))
                       for b in range(seq.computed, seq.computed + take, width)]
        shape = (pow2(len(blocks)), width)
        ids, pos = np.zeros(shape, np.int32), np.full(shape, -1, np.int32)
        wp, wo = np.full(shape, SINK_PAGE, np.int32), np.zeros(shape, np.int32)
        for j, (seq, start, stop) in enumerate(blocks):
            n = stop - start
            ids[j, :n] = (seq.req.input_ids + seq.out_ids)[start:stop]
            pos[j, :n] = np.arange(start, stop)
            wp[j, :n], wo[j, :n] = seq.sched.table.write_slots(start, stop)
        work = self._work([seq.sched.table.pages for seq, _, _ in blocks], [stop for _, _, stop in blocks])
        self.stats["prefill_padded_tokens"] += ids.size
        self.stats["prefill_tokens"] += sum(t for _, _, t in rows)
        return rows, (ids, pos, wp, wo, work)

    async def _mixed_paged(self, lane: _Lane, prefill: list[_Seq], decode: list[_Seq]) -> None:
        """One mixed call: a prefill chunk of ``prefill`` and one token of each of ``decode``."""
        rows, blocks = self._prefill_blocks(prefill)
        tokens, positions, step, count, wp, wo, p, work = self._decode_rows(decode, 1)
        self.compiled_shapes.add(("mixed", len(tokens), len(blocks[0]), len(work[0]), len(blocks[4][0])))
        version = self._version
        out = await self._timed("mixed_seconds", self._run_mixed, lane, tokens, positions, wp[:, 0], wo[:, 0], work,
                                *blocks, p.temperature, p.top_p, p.top_k, p.seed, p.stream, step, p.top_n)
        self.stats["mixed_calls"] += 1
        for seq, start, take in rows:
            if seq.finish_reason is None and seq.sched.table is not None and seq.computed == start:
                seq.computed = start + take
                self.stats["prefill_chunks"] += seq.computed < seq.length - 1
        main, top_values, top_ids = out
        self._take_tokens(decode, count, version, main[:, None], top_values[None], top_ids[None], 1)

    def _run_step(self, fn: Any, state: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one compiled paged step on host arrays ``args`` (placed replicated on a mesh)."""
        with activate(self.mesh):
            return fn(state, cache, *jax.tree.map(self._replicated, args), **kwargs)

    def _run_paged(self, fn: Any, state: Any, cache: Any, *args: Any) -> Any:
        return self._run_step(fn, state, cache, *args)

    def _run_mixed(self, lane: _Lane, *args: Any) -> tuple[np.ndarray, ...]:
        lane.cache, out = self._run_step(self.mixed_fn, self._state, lane.cache, *args, max_top=self.max_top)
        return tuple(np.asarray(x) for x in jax.device_get(out))

    def _run_decode(self, lane: _Lane, *args: Any) -> tuple[np.ndarray, ...]:
        lane.cache, out = self._run_step(self.decode_fn, self._state, lane.cache, *args,
                                         num_steps=self.cfg.decode_steps, max_top=self.max_top)
        return tuple(np.asarray(x) for x in jax.device_get(out))

    # -- compile ahead --

    @property
    def min_decode_rows(self) -> int:
        return min(MIN_DECODE_ROWS, pow2(self.cfg.num_slots))

    def step_shapes(self) -> list[tuple[Any, ...]]:
        """The shapes ``warmup`` compiles: those of the first short requests. Mixed steps
        ``("mixed", rows, blocks, work, prefill work)``: one and two prefill blocks beside the
        fewest decode rows (on the alternating path, ``("prefill", rows, width, work)`` of one and
        two short prompts), and ``("decode", rows, steps, work)`` of the fewest rows. Every other
        shape compiles when first used (``compiled_shapes``)."""
        rows = self.min_decode_rows
        if self.mixed_chunk:
            first = [("mixed", rows, 1, MIN_WORK, MIN_WORK), ("mixed", rows, 2, MIN_WORK, MIN_WORK)]
        else:
            first = [("prefill", 1, MIN_WIDTH, MIN_WORK), ("prefill", 2, MIN_WIDTH, MIN_WORK)]
        return [*first, ("decode", rows, self.cfg.decode_steps, MIN_WORK)]

    def warmup(self, stop: Any = None) -> int:
        """Compile ``step_shapes`` by running each on padding (every write goes to the sink page);
        returns how many. Call before ``start()``."""
        if self._running:
            raise RuntimeError("warmup() runs before start(): it steps the pool")
        lane = self._lanes[0]
        work = lambda n: (np.zeros((n,), np.int32), np.zeros((n,), np.int32), np.full((n,), NO_POSITION, np.int32))
        for done, shape in enumerate(self.step_shapes()):
            if stop is not None and stop.is_set():
                return done
            kind, rows, width, size = shape[:4]
            if kind == "mixed":  # (mixed, rows, blocks, work, prefill work)
                p, z, none = _SamplingRows(rows), np.zeros((rows,), np.int32), np.full((rows,), -1, np.int32)
                ids = np.zeros((width, self.prefill_block), np.int32)
                self._run_mixed(lane, z, none, z + SINK_PAGE, z, work(size), ids, ids - 1, ids + SINK_PAGE, ids,
                                work(shape[4]), p.temperature, p.top_p, p.top_k, p.seed, p.stream, z, p.top_n)
                self.compiled_shapes.add(shape)
                continue
            zeros, sink = np.zeros((rows, width), np.int32), np.full((rows, width), SINK_PAGE, np.int32)
            if kind == "prefill":  # (prefill, rows, width, work)
                lane.cache = self._run_paged(self.prefill_fn, self._state, lane.cache, zeros,
                                             np.full((rows, width), -1, np.int32), sink, zeros, work(size))
            elif kind == "decode":
                p, z = _SamplingRows(rows), np.zeros((rows,), np.int32)
                self._run_decode(lane, z, z, sink, zeros, work(size), p.temperature, p.top_p, p.top_k, p.seed,
                                 p.stream, z, p.top_n, z, p.stop_ids, np.bool_(False))
            self.compiled_shapes.add(shape)
        return len(self.step_shapes())
