"""The slot engine: continuous batching over fixed KV slots in one or more lanes.

Requests enter as soon as a slot frees: waiting prompts are prefilled together (rows padded to a
length bucket, each row written into its own slot; a prompt longer than ``chunked_prefill_size``
alone, in chunks), then one compiled call advances every slot of a lane by up to
``decode_steps`` tokens, attending only up to a bucketed live length (while requests wait, a
chunk ends where a running request ends, so its slot is refilled at once). Every slot owns
``max_seq_len`` positions of cache. The queue, streams, aborts, pauses, weight swaps and the lane
loops are the engines' shared API (``inference.base``).

This is ``EngineConfig.kv_cache = "slots"``; ``Engine(model, cfg)`` with the default ``"paged"``
builds ``inference.paged.PagedEngine``, which keeps this API and bookkeeping over one pool of KV
pages.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from areal_jax.inference.base import PAUSE_MODES, EngineBase
from areal_jax.inference.config import EngineConfig
from areal_jax.inference.requests import _Lane, _SamplingRows, _Seq, _tokens_key
from areal_jax.inference.steps import DEVICE_STOP_IDS, SlotState, bucket, compile_steps, share_rows, step_shapes
from areal_jax.inference.weight_swap import _placement
from areal_jax.models.decoder import Decoder
from areal_jax.models.slot_cache import KVCache
from sharding import activate, logical_to_sharding

log = logging.getLogger(__name__)

__all__ = ["PAUSE_MODES", "Engine", "EngineConfig"]
# also importable from here, as before the split: the request state the paged engine shares
__all__ += ["_Lane", "_SamplingRows", "_Seq", "_placement", "_tokens_key"]

PREFILL_SCAN = 512
"""Waiting requests one prefill call looks through, in arrival order, for those that fit its
padded length."""


class Engine(EngineBase):
    """Continuous-batching generation over fixed KV slots (see the module docstring).

    ``Engine(model, cfg)`` with ``cfg.kv_cache == "paged"`` builds the paged engine
    (``inference.paged.PagedEngine``), which has the same API."""

    def __new__(cls, model: Decoder, cfg: EngineConfig, **kwargs: Any) -> Engine:
        if cls is Engine and cfg.kv_cache == "paged":
            from areal_jax.inference.paged import PagedEngine
            cls = PagedEngine
        return super().__new__(cls)

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        super().__init__(model, cfg, eos_token_ids=eos_token_ids, mesh=mesh, version=version)
        steps = compile_steps(self._graphdef, self.max_top)
        self.prefill_fn, self.prefill_chunk_fn, self.decode_fn = steps.prefill, steps.prefill_chunk, steps.decode
        self.share_fn = steps.share
        self.prompt_logprobs_fn = steps.prompt_logprobs
        self.share_rows = share_rows(self.lane_slots)
        """Padded row counts of a ``share`` call (requests given a copy of another's prefill)."""

    def server_info(self) -> dict[str, Any]:
        """The engine's limits under SGLang's /get_server_info names (``max_total_num_tokens``:
        the tokens the KV cache holds; ``max_req_input_len``: the longest prompt)."""
        return {"max_total_num_tokens": self.cfg.num_slots * self.max_seq_len, "page_size": 1,
                "max_running_requests": self.cfg.num_slots, "context_length": self.max_seq_len,
                "max_req_input_len": self.max_seq_len - 1, "chunked_prefill_size": self.cfg.chunked_prefill_size,
                "disable_radix_cache": not self.cfg.share_prompts, "kv_cache": "slots"}

    # -- compile ahead --

    def step_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every compiled-step shape the scheduler can ask for (``steps.step_shapes``)."""
        return step_shapes(self.cfg, self.lane_slots)

    def warmup(self, stop: threading.Event | None = None) -> int:
        """Compile every step shape before serving, by running each once on padding (rows that
        write nowhere, or free slots); returns how many. Call before ``start()``: it uses the
        first lane's cache, and the lanes share the compiled steps. Once ``stop`` is set (a
        server shutting down), it returns after the shape in hand, with how many it compiled."""
        if self._running:
            raise RuntimeError("warmup() runs before start(): it steps the first lane's cache")
        lane = self._lanes[0]
        for done, (step, rows, length, kv_len) in enumerate(self.step_shapes()):
            if stop is not None and stop.is_set():
                return done
            ids, zeros = np.zeros((rows, length), np.int32), np.zeros((rows,), np.int32)
            slots = np.full((rows,), self.lane_slots, np.int32)  # padding rows: every write drops
            if step == "decode":
                lane.cache, lane.slot_state, _ = self._run_step(
                    self.decode_fn, self._state, lane.cache, lane.slot_state, np.zeros((self.lane_slots,), bool),
                    np.bool_(False), kv_len=kv_len, num_steps=self.cfg.decode_steps)
            elif step == "prefill_chunk":
                lane.cache = self._run_chunk(lane.cache, ids, np.int32(0), zeros, slots, kv_len)
            elif step == "share":
                lane.cache, lane.slot_state = self._in_mesh(self.share_fn, lane.cache, lane.slot_state,
                                                            *self._share_args([], rows))
            else:
                ones, u32 = np.ones((rows,), np.float32), np.zeros((rows,), np.uint32)
                lane.cache, lane.slot_state, _ = self._run_step(
                    self.prefill_fn, self._state, lane.cache, lane.slot_state, ids, np.int32(0), zeros, slots, zeros,
                    ones, ones, np.full((rows,), -1, np.int32), u32, u32, zeros, zeros,
                    np.full((rows, DEVICE_STOP_IDS), -1, np.int32), kv_len=kv_len)
        return len(self.step_shapes())

    # -- the lane loop's rounds --

    def _fresh_cache(self) -> tuple[Any, SlotState]:
        """A zero cache and empty slot state for one lane."""
        with activate(self.mesh):
            dtype = self.cfg.cache_dtype and np.dtype(self.cfg.cache_dtype)
            cache = self.model.init_cache(self.lane_slots, self.cfg.max_seq_len, dtype)
            state = SlotState.empty(self.lane_slots)
            if self.mesh is not None:
                shard = lambda x, axes: jax.device_put(x, logical_to_sharding(axes, self.mesh))
                cache = KVCache(*map(shard, cache, KVCache.axes()))
                state = jax.device_put(state, logical_to_sharding((None,), self.mesh))
        return self._committed(cache), self._committed(state)

    def _can_step(self, lane: _Lane) -> bool:
        if self._paused is not None:
            return False
        return any(s is not None for s in lane.slots) or (bool(self._waiting) and None in lane.slots)

    async def _round(self, lane: _Lane) -> None:
        """One round of ``lane``'s loop: prefill waiting requests into free slots, else decode."""
        if self._waiting and None in lane.slots:
            await self._prefill(lane)
        elif lane.running:
            await self._decode(lane)

    def _recover(self, lane: _Lane, e: Exception) -> None:
        """After a failed round: fail ``lane``'s requests (HTTP 500) and give it a fresh cache."""
        log.exception("engine step failed (lane %d)", lane.index)
        self._abort_where(lambda s: s.lane is lane, f"engine error: {e!r}", status_code=500)
        lane.cache = lane.slot_state = None  # free the old cache before the new one
        lane.cache, lane.slot_state = self._fresh_cache()

    def _take_prefill_batch(self, lane: _Lane) -> list[_Seq]:
        """Waiting requests for one prefill: the oldest, then, in arrival order, those that fit
        its padded length (its ``prefill_buckets`` bucket), so a long request does not pad a call
        of short ones to its length (answers sent again after a pause carry their own tokens and
        vary most); or one long prompt alone, to be prefilled in chunks. A request left out goes
        in a later call, in its own padded length. With ``share_prompts``, a request whose tokens
        equal an earlier one's in the batch costs no prefill row, so only distinct prompts count
        against ``max_prefill_batch`` and ``max_prefill_tokens``."""
        cfg, chunk = self.cfg, self.cfg.prefill_chunk
        head = next(iter(self._waiting.values()))
        if chunk is not None and head.length > chunk:
            del self._waiting[head.stream_id]
            return [head]
        window = bucket(head.length, cfg.prefill_buckets)
        rows = min(cfg.max_prefill_batch, max(1, cfg.max_prefill_tokens // window))
        batch: list[_Seq] = []
        distinct: set[tuple[int, ...]] = set()
        for seq in itertools.islice(self._waiting.values(), PREFILL_SCAN):
            if len(batch) >= len(lane.free):
                break
            if seq.length > window or (chunk is not None and seq.length > chunk):
                continue
            key = _tokens_key(seq) if cfg.share_prompts else (seq.stream_id,)
            if key not in distinct:
                if len(distinct) >= rows:
                    break
                distinct.add(key)
            batch.append(seq)
        for seq in batch:
            del self._waiting[seq.stream_id]
        return batch

    async def _prefill(self, lane: _Lane) -> None:
        """Prefill the next batch of waiting requests into ``lane``'s free slots and sample each
        one's next token: distinct token lists one row each (a long prompt alone, in chunks),
        requests that repeat an earlier one's tokens copied from its row."""
        cfg = self.cfg
        free = lane.free
        batch = self._take_prefill_batch(lane)
        chunk = cfg.prefill_chunk
        chunked = chunk is not None and batch[0].length > chunk
        batch, followers = (batch, []) if chunked else self._leaders_and_followers(batch)
        length = chunk if chunked else bucket(max(s.length for s in batch), cfg.prefill_buckets)
        rows = bucket(len(batch), cfg.prefill_rows)
        lengths = np.zeros((rows,), np.int32)
        slots = np.full((rows,), self.lane_slots, np.int32)  # padding rows write nowhere
        first_step = np.zeros((rows,), np.int32)
        params = _SamplingRows(rows)
        tokens = []
        for i, seq in enumerate(batch):
            toks = seq.req.input_ids + seq.out_ids
            tokens.append(toks)
            lengths[i], slots[i], first_step[i] = len(toks), free[i], len(seq.out_ids)
            # the prefill samples one token; a decode chunk sees the request end after the rest
            params.fill(i, seq, self, sampled_here=True)
            seq.lane, seq.slot = lane, free[i]
            lane.slots[free[i]] = seq
        self.stats["prompt_tokens"] += int(lengths.sum())
        self.stats["prefill_padded_tokens"] += rows * length  # the rows the call computes, padding included

        def window(offset: int) -> np.ndarray:
            ids = np.zeros((rows, length), np.int32)
            for i, toks in enumerate(tokens):
                part = toks[offset:offset + length]
                ids[i, :len(part)] = part
            return ids

        offset, kv_len = 0, length
        if chunked:  # every chunk but the last writes KV only; the last one samples
            offset = await self._prefill_chunks(lane, batch[0], window, lengths, slots)
            if offset is None:
                return
            kv_len = bucket(min(offset + chunk, int(lengths[0])), cfg.kv_buckets)
        share = (self._place_followers(lane, followers, free[len(batch):len(batch) + len(followers)], slots)
                 if followers else None)
        version = self._version
        lane.cache, lane.slot_state, out = await self._timed(
            "prefill_seconds", self._run_step, self.prefill_fn, self._state, lane.cache, lane.slot_state,
            window(offset), np.int32(offset), lengths, slots, first_step, *params.arrays(), kv_len=kv_len, share=share)
        self.stats["prefill_calls"] += 1
        main, top_values, top_ids = out
        for i, seq in enumerate(batch):
            if lane.slots[free[i]] is seq:  # not aborted or retracted meanwhile
                self._append(seq, int(main[0, i]), float(main[1, i]), version, top_values[i], top_ids[i])
                self._notify(seq)

    def _leaders_and_followers(self, batch: list[_Seq]) -> tuple[list[_Seq], list[tuple[_Seq, int]]]:
        """With ``share_prompts``: the requests of ``batch`` whose tokens no earlier one has (each
        prefilled in its own row), and the others as ``(request, row of the one it copies)``."""
        if not self.cfg.share_prompts or len(batch) < 2:
            return batch, []
        leaders: dict[tuple[int, ...], int] = {}
        rows_of: list[_Seq] = []
        followers: list[tuple[_Seq, int]] = []
        for seq in batch:
            key = _tokens_key(seq)
            if key in leaders:
                followers.append((seq, leaders[key]))
            else:
                leaders[key] = len(rows_of)
                rows_of.append(seq)
        return rows_of, followers

    async def _prefill_chunks(self, lane: _Lane, seq: _Seq, window: Any, lengths: np.ndarray,
                              slots: np.ndarray) -> int | None:
        """Write every chunk but the last of ``seq``'s long prompt into its slot; the offset of the
        last chunk, or None when the request went away or a pause sent it back to the queue."""
        chunk, total, offset, slot = self.cfg.prefill_chunk, int(lengths[0]), 0, seq.slot
        assert chunk is not None
        while total - offset > chunk:
            kv_len = bucket(offset + chunk, self.cfg.kv_buckets)
            lane.cache = await self._timed("prefill_seconds", self._run_chunk, lane.cache, window(offset),
                                           np.int32(offset), lengths, slots, kv_len)
            self.stats["prefill_chunks"] += 1
            self.stats["prefill_padded_tokens"] += len(lengths) * chunk
            offset += chunk
            if lane.slots[slot] is not seq:  # aborted or retracted meanwhile
                return None
            if self._paused is not None:  # a pause does not wait for the whole prompt:
                self._release(seq)  # back to the queue front, prefilled again on resume
                self._waiting[seq.stream_id] = seq
                self._waiting.move_to_end(seq.stream_id, last=False)
                return None
        return offset

    def _place_followers(self, lane: _Lane, followers: list[tuple[_Seq, int]], free: list[int],
                         slots: np.ndarray) -> tuple[np.ndarray, ...]:
        """Give each follower a slot of ``free`` and the arguments of the ``share`` call that
        copies its leader's row (in ``slots``) into it."""
        placed = []
        for (seq, leader), slot in zip(followers, free, strict=True):
            seq.lane, seq.slot = lane, slot
            seq.cached = seq.cached or seq.length
            lane.slots[slot] = seq
            placed.append((seq, int(slots[leader]), slot))
        shared = sum(seq.length for seq, _ in followers)
        self.stats["prompt_tokens"] += shared
        self.stats["shared_prompt_tokens"] += shared
        return self._share_args(placed, bucket(len(placed), self.share_rows))

    def _run_chunk(self, cache: Any, *args: Any) -> Any:
        *rest, kv_len = args
        with activate(self.mesh):
            return self.prefill_chunk_fn(self._state, cache, *rest, kv_len=kv_len)

    async def _decode(self, lane: _Lane) -> None:
        n = self.cfg.decode_steps
        live = lane.running
        kv_len = bucket(max(s.length - 1 for s in live) + n, self.cfg.kv_buckets)
        version = self._version
        active = np.array([s is not None for s in lane.slots])
        waiting = bool(self._waiting)  # someone wants a slot: end the chunk where a request ends
        lane.cache, lane.slot_state, out = await self._timed(
            "decode_seconds", self._run_step, self.decode_fn, self._state, lane.cache, lane.slot_state, active,
            np.bool_(waiting and self.cfg.end_chunk_at_finish),
            kv_len=kv_len, num_steps=n)
        self.stats["decode_calls"] += 1
        main, top_values, top_ids, steps = out
        steps = int(steps)
        self.stats["decode_steps"] += steps
        tokens, logprobs = main[0].astype(np.int64).tolist(), main[1].tolist()
        for seq in live:
            if seq.lane is not lane:  # aborted or retracted meanwhile
                continue
            slot = seq.slot
            for i in range(steps):
                self.stats["decode_tokens"] += 1
                if self._append(seq, tokens[i][slot], logprobs[i][slot], version, top_values[i, slot],
                                top_ids[i, slot]):
                    idle = steps - 1 - i  # steps this slot computed for a finished request
                    self.stats["finished_slot_steps"] += idle
                    self.stats["idle_slot_steps_while_waiting"] += idle if waiting else 0
                    break
            self._notify(seq)

    def _run_step(self, fn: Any, *args: Any, share: tuple[np.ndarray, ...] | None = None,
                  **kwargs: Any) -> tuple[Any, SlotState, tuple[np.ndarray, ...]]:
        """Run one compiled step and fetch its outputs; a prefill with ``share`` (``_share_args``)
        copies its rows into the sharing requests' slots before the fetch."""
        with activate(self.mesh):
            cache, state, out = fn(*args, **kwargs)
            if share is not None:
                cache, state = self.share_fn(cache, state, *share)
            return cache, state, tuple(np.asarray(x) for x in jax.device_get(out))

    def _share_args(self, placed: list[tuple[_Seq, int, int]], rows: int) -> tuple[np.ndarray, ...]:
        """The arrays of a ``share`` call of ``rows`` padded rows for ``(request, slot it copies,
        its own slot)``: each request's last token is fed again by the next decode chunk, which
        samples its first token with the PRNG stream step a prefill would have used."""
        src, dst = np.zeros((rows,), np.int32), np.full((rows,), self.lane_slots, np.int32)
        tokens, positions, step = (np.zeros((rows,), np.int32) for _ in range(3))
        params = _SamplingRows(rows)
        length = 0
        for i, (seq, from_slot, slot) in enumerate(placed):
            n = seq.length
            src[i], dst[i] = from_slot, slot
            tokens[i] = seq.out_ids[-1] if seq.out_ids else seq.req.input_ids[-1]
            positions[i], step[i] = n - 1, len(seq.out_ids)
            params.fill(i, seq, self, sampled_here=False)
            length = max(length, n - 1)
        return (src, dst, np.int32(length), tokens, positions, step, *params.arrays())

    def prompt_logprobs(self, input_ids: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For positions 1 .. n-1 of a prompt: the logprob of each token given the ones before it
        and the ``max_top`` likeliest tokens there (values, ids), under ``log_softmax(logits / T)``
        and the weights served now. One full forward, padded to a prefill bucket; blocking (run it
        in a thread)."""
        n = len(input_ids)
        ids = np.zeros((1, bucket(n, self.cfg.prefill_buckets)), np.int32)
        ids[0, :n] = input_ids
        with activate(self.mesh):
            out = self.prompt_logprobs_fn(self._state, ids, np.float32(temperature))
            chosen, values, top = (np.asarray(x) for x in jax.device_get(out))
        return chosen[:n - 1], values[:n - 1], top[:n - 1]
