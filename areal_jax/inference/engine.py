"""The generation engine: continuous batching over fixed KV slots in one or more lanes.

Requests wait in a FIFO queue (bounded by ``max_queued_requests``) and enter as soon as a slot
frees: waiting prompts are prefilled together (rows padded to a length bucket, each row written
into its own slot; a prompt longer than ``chunked_prefill_size`` alone, in chunks), then one
compiled call advances every slot of a lane by up to ``decode_steps`` tokens, attending only up
to a bucketed live length (while requests wait, a chunk ends where a running request ends, so its
slot is refilled at once). A lane is a group of slots with its own cache and its own asyncio task; lanes share the
queue, the weights and the compiled steps, and their calls run concurrently in worker threads
(``asyncio.to_thread``), so the event loop that owns the engine (an HTTP server, say) stays
responsive. Scheduling state lives on the event loop; a lane changes its slots only under its own
lock, held from launch to the bookkeeping of the result, and engine-wide changes (pause, abort
all, weight swap) take every lane's lock. Aborting or cancelling one request takes no lock and
costs O(1): the queue is keyed by request, and a step whose request went away ignores its result.
A weight update reads and converts the new weights outside the locks and only swaps them in
under them.

This is the slot engine (``EngineConfig.kv_cache = "slots"``); ``"paged"`` builds
``inference.paged.PagedEngine``, which keeps this API and bookkeeping over one pool of KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.steps import DEVICE_STOP_IDS, SlotState, bucket, compile_steps, share_rows, step_shapes
from areal_jax.inference.types import (
    DuplicateRequestError,
    EngineDeadError,
    GenerateOutput,
    GenerateRequest,
    QueueFullError,
)
from areal_jax.inference.weights import WeightStage, check_swappable, new_state
from areal_jax.models.decoder import Decoder, KVCache
from sharding import activate, logical_to_sharding

__all__ = ["PAUSE_MODES", "Engine", "EngineConfig"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")

PREFILL_SCAN = 512
"""Waiting requests one prefill call looks through, in arrival order, for those that fit its
padded length."""


@dataclass(eq=False)
class _Seq:
    req: GenerateRequest
    stream_id: int
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[float, int]]] = field(default_factory=list)
    """The ``top_logprobs_num`` likeliest (logprob, token id) at each output token, if asked for."""
    finish_reason: dict | None = None
    lane: _Lane | None = None
    slot: int | None = None
    """Index within ``lane.slots`` while the request holds a slot."""
    done: asyncio.Future | None = None
    updated: asyncio.Event | None = None
    """Set when a streamed request has new tokens or finished; its reader takes what is new."""
    sched: Any = None
    """The paged engine's scheduler request (``inference.paged``); None on the slot path."""
    computed: int = 0
    """Paged engine: tokens of ``prompt + output`` whose keys and values are in its pages."""
    shared: int = 0
    """Paged engine: tokens of those in pages another request writes (a shared prompt)."""
    source: Any = None
    """Paged engine: the request that writes the shared pages, until they are written."""

    @property
    def length(self) -> int:
        return len(self.req.input_ids) + len(self.out_ids)


class _SamplingRows:
    """Per-row sampling arrays of a prefill or share call, in the compiled steps' argument order
    (``temperature, top_p, top_k, seed, stream, top_n, remaining, stop_ids``); padding rows keep
    SGLang's defaults."""

    def __init__(self, rows: int) -> None:
        self.temperature, self.top_p = np.ones((rows,), np.float32), np.ones((rows,), np.float32)
        self.top_k, self.top_n = np.full((rows,), -1, np.int32), np.zeros((rows,), np.int32)
        self.remaining, self.stop_ids = np.zeros((rows,), np.int32), np.full((rows, DEVICE_STOP_IDS), -1, np.int32)
        self.seed, self.stream = np.zeros((rows,), np.uint32), np.zeros((rows,), np.uint32)

    def fill(self, i: int, seq: _Seq, engine: Engine, *, sampled_here: bool) -> None:
        """Row ``i`` for ``seq``. ``remaining`` counts the tokens the decode chunks may sample:
        one fewer when this call samples the request's next token itself (a prefill)."""
        sp = seq.req.sampling
        self.temperature[i], self.top_p[i], self.top_k[i] = sp.temperature, sp.top_p, sp.top_k
        self.top_n[i] = sp.top_logprobs_num
        self.remaining[i] = (min(sp.max_new_tokens - len(seq.out_ids), engine.max_seq_len - seq.length)
                             - int(sampled_here))
        stops = [*(sp.stop_token_ids or ()), *(() if sp.ignore_eos else sorted(engine.eos_token_ids))]
        self.stop_ids[i, :min(len(stops), DEVICE_STOP_IDS)] = stops[:DEVICE_STOP_IDS]
        self.seed[i], self.stream[i] = (sp.seed, 0) if sp.seed is not None else (engine.seed, seq.stream_id)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.temperature, self.top_p, self.top_k, self.seed, self.stream, self.top_n, self.remaining,
                self.stop_ids)


@dataclass(eq=False)
class _Lane:
    """A group of KV slots with its own cache, slot state, step lock and loop task."""

    index: int
    slots: list[_Seq | None]
    cache: Any = None
    slot_state: SlotState | None = None
    lock: asyncio.Lock | None = None
    wake: asyncio.Event | None = None
    task: asyncio.Task | None = None

    @property
    def running(self) -> list[_Seq]:
        return [s for s in self.slots if s is not None]

    @property
    def free(self) -> list[int]:
        return [i for i, s in enumerate(self.slots) if s is None]


class Engine:
    """Continuous-batching generation over a ``Decoder`` (see the module docstring).

    ``Engine(model, cfg)`` with ``cfg.kv_cache == "paged"`` builds the paged engine
    (``inference.paged.PagedEngine``), which has the same API."""

    def __new__(cls, model: Decoder, cfg: EngineConfig, **kwargs: Any) -> Engine:
        if cls is Engine and cfg.kv_cache == "paged":
            from areal_jax.inference.paged import PagedEngine
            cls = PagedEngine
        return super().__new__(cls)

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self._version = version
        self.eos_token_ids = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._graphdef, state = nnx.split(model)
        self._state = self._committed(state)
        self.max_top = max(1, min(cfg.max_top_logprobs, model.config.vocab_size))
        steps = compile_steps(self._graphdef, self.max_top)
        self.prefill_fn, self.prefill_chunk_fn, self.decode_fn = steps.prefill, steps.prefill_chunk, steps.decode
        self.share_fn = steps.share
        self.prompt_logprobs_fn = steps.prompt_logprobs
        # at[].set writes into the donated input buffer (zeros_like would not use it, so XLA would not
        # reuse it): a flush never holds two caches.
        self._zero_fn = jax.jit(lambda cache: jax.tree.map(lambda x: x.at[:].set(0), cache), donate_argnums=0)
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
        """Seed of requests that bring none: ``cfg.seed``, or drawn at random per engine."""
        self.num_lanes = self._resolve_lanes()
        self.lane_slots = cfg.num_slots // self.num_lanes
        self._lanes = [_Lane(i, [None] * self.lane_slots) for i in range(self.num_lanes)]
        self.share_rows = share_rows(self.lane_slots)
        """Padded row counts of a ``share`` call (requests given a copy of another's prefill)."""
        for lane in self._lanes:
            lane.cache, lane.slot_state = self._fresh_cache()
        self._waiting: OrderedDict[int, _Seq] = OrderedDict()  # by stream id: O(1) removal anywhere
        self._live: dict[str, _Seq] = {}  # rid -> waiting or running request
        self._counter = itertools.count(1)
        self._paused: str | None = None
        self._running = False
        self._error: BaseException | None = None
        self._dead_waiters: list[asyncio.Future] = []
        self._update_lock: asyncio.Lock | None = None
        self._pause_lock: asyncio.Lock | None = None
        """Held by ``pause`` (while it waits for the steps in flight) and ``resume``: the two
        run in the order they were called, so a resume is never undone by the pause before it."""
        self.stats = {"prefill_calls": 0, "prefill_chunks": 0, "decode_calls": 0, "decode_steps": 0, "decode_tokens": 0,
                      "prompt_tokens": 0, "shared_prompt_tokens": 0, "generated_tokens": 0, "finished_requests": 0,
                      "finished_slot_steps": 0, "idle_slot_steps_while_waiting": 0,
                      "prefill_padded_tokens": 0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
                      "paused_seconds": 0.0}
        """``prefill_seconds`` and ``decode_seconds``: wall seconds from handing a compiled prefill
        (its chunks included) or decode call to the worker thread to holding its result, summed
        over lanes (so with several lanes they can add up to more than the time that passed).
        ``paused_seconds``: wall seconds between each ``pause`` and the ``resume`` after it, the
        time weight updates keep the engine from generating."""
        self._paused_at = 0.0

    def _resolve_lanes(self) -> int:
        return self.cfg.resolve_lanes(jax.default_backend(), self.mesh is not None)

    # -- properties --

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return sum(len(lane.running) for lane in self._lanes)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_free_slots(self) -> int:
        """KV slots no request holds; equal to ``num_slots`` when the engine is idle."""
        return sum(len(lane.free) for lane in self._lanes)

    @property
    def num_live(self) -> int:
        """Requests the engine still tracks (waiting or running); 0 when idle."""
        return len(self._live)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def alive(self) -> bool:
        """Started, not stopped, and able to generate: every lane's loop still running. A failed
        step does not end a loop (its requests fail and the lane gets a fresh cache); a lane
        whose fresh cache cannot be allocated either, or a bug, ends it and the engine is dead
        (``error``)."""
        return (self._running and self._error is None
                and all(lane.task is not None and not lane.task.done() for lane in self._lanes))

    @property
    def error(self) -> BaseException | None:
        """What killed the engine (see ``alive``); None while it can generate."""
        return self._error

    async def wait_dead(self) -> BaseException:
        """Return once the engine is dead (a server exits then, so that it is restarted), with
        what killed it."""
        if self._error is None:  # a future, not an Event: it may be awaited before start()
            waiter = asyncio.get_running_loop().create_future()
            self._dead_waiters.append(waiter)
            try:
                await waiter
            finally:
                self._dead_waiters.remove(waiter)
        assert self._error is not None
        return self._error

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None while running."""
        return self._paused

    # -- lifecycle --

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._update_lock, self._pause_lock = asyncio.Lock(), asyncio.Lock()
        for lane in self._lanes:
            lane.lock, lane.wake = asyncio.Lock(), asyncio.Event()
            lane.task = asyncio.create_task(self._loop(lane), name=f"engine-lane-{lane.index}")
            lane.task.add_done_callback(self._lane_ended)

    async def stop(self) -> None:
        """Finish the steps in flight, abort every request, and end the lane loops."""
        if not self._running:
            return
        self._running = False
        tasks = [lane.task for lane in self._lanes]
        async with self._all_lanes():
            for task in tasks:
                task.cancel()
            self._abort_where(lambda s: True, "engine stopped")
        # a lane that died has said so (``error``, the log): stopping is not the place to raise it
        await asyncio.gather(*tasks, return_exceptions=True)

    @contextlib.asynccontextmanager
    async def _all_lanes(self) -> AsyncIterator[None]:
        """Hold every lane's lock (taken in lane order, so two holders cannot deadlock)."""
        async with contextlib.AsyncExitStack() as stack:
            for lane in self._lanes:
                await stack.enter_async_context(lane.lock)
            yield

    def _wake_all(self) -> None:
        for lane in self._lanes:
            lane.wake.set()

    # -- requests --

    def _admit(self, req: GenerateRequest, streaming: bool) -> _Seq:
        if not self._running:
            raise RuntimeError("Engine.start() has not been awaited")
        if self._error is not None:
            raise EngineDeadError(f"the engine is dead: {self._error!r}")
        if req.rid in self._live:
            raise DuplicateRequestError(f"rid {req.rid!r} is already waiting or running; give each request its own rid")
        cap = self.cfg.max_queued_requests
        if cap is not None and self.num_waiting >= cap and req.sampling.max_new_tokens:
            raise QueueFullError(f"the waiting queue is full ({cap} requests); retry later")
        req.sampling.validate(self.vocab_size)
        if req.sampling.top_logprobs_num > self.cfg.max_top_logprobs:
            raise ValueError(f"top_logprobs_num must be at most {self.cfg.max_top_logprobs} "
                             f"(EngineConfig.max_top_logprobs), got {req.sampling.top_logprobs_num}")
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids is empty")
        if n >= self.max_seq_len:
            raise ValueError(f"prompt of {n} tokens does not fit: prompt + output must be at most "
                             f"max_seq_len={self.max_seq_len} tokens (the context length)")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        seq = _Seq(req, next(self._counter), done=asyncio.get_running_loop().create_future(),
                   updated=asyncio.Event() if streaming else None)
        if req.sampling.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
        else:
            self._enqueue(seq)
            self._live[req.rid] = seq
            self._wake_all()
        return seq

    def _enqueue(self, seq: _Seq) -> None:
        """Put a new request at the back of the waiting queue."""
        self._waiting[seq.stream_id] = seq

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Run ``req`` to completion; cancelling the caller aborts the request."""
        seq = self._admit(req, streaming=False)
        try:
            return await asyncio.shield(seq.done)
        except asyncio.CancelledError:
            self._abort_seq(seq, "client cancelled")
            raise

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield the tokens new since the previous output as they arrive: each output's
        ``output_ids``, ``output_logprobs``, ``output_versions`` (and top logprobs) hold only the
        new ones; the last output is finished (and may hold none). A slow reader gets the steps it
        missed in one output, so nothing queues up and each output costs what it carries."""
        seq = self._admit(req, streaming=True)
        sent = 0
        try:
            while True:
                await seq.updated.wait()
                seq.updated.clear()
                n, finished = len(seq.out_ids), seq.finish_reason is not None
                if n > sent or finished:
                    yield self._snapshot(seq, sent, n)
                    sent = n
                if finished:
                    return
        finally:
            self._abort_seq(seq, "client cancelled")

    async def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request (by rid, O(1), no lock) or all (between steps); they return their
        partial output, finished as ``{"type": "abort", "message": message}``. Returns how many."""
        if abort_all:
            async with self._all_lanes():
                return self._abort_where(lambda s: True, message)
        seq = self._live.get(rid) if rid is not None else None
        return int(seq is not None and self._abort_seq(seq, message))

    async def pause(self, mode: str = "abort") -> None:
        """Stop stepping after the steps in flight. ``abort``: every request returns now (partial
        output); ``retract``: running requests go back to the queue front and, after resume,
        recompute their KV and continue; ``in_place``: slots and KV stay as they are."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        async with self._pause_lock or contextlib.nullcontext():
            await self._pause(mode)

    async def _pause(self, mode: str) -> None:
        if self._paused is None:
            self._paused_at = time.perf_counter()
        self._paused = mode
        async with self._all_lanes():
            if mode == "abort":
                self._abort_where(lambda s: True, "paused with mode abort")
            elif mode == "retract":
                running = sorted((s for lane in self._lanes for s in lane.running), key=lambda s: s.stream_id)
                for seq in reversed(running):
                    self._release(seq)
                    self._waiting[seq.stream_id] = seq
                    self._waiting.move_to_end(seq.stream_id, last=False)

    async def resume(self) -> None:
        """Step again; a ``pause`` still waiting for the steps in flight finishes first."""
        async with self._pause_lock or contextlib.nullcontext():
            if self._paused is not None:
                self.stats["paused_seconds"] += time.perf_counter() - self._paused_at
            self._paused = None
            self._wake_all()

    async def update_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                             stage: WeightStage | None = None, version: int) -> None:
        """Swap in new weights: HF-named ``tensors`` (any subset), a whole HF ``model_dir``, or a
        ``stage`` (``stage_weights``) filled part by part.

        Nothing changes unless every tensor is valid; on error the old weights keep serving and
        the error is raised. The new weights are read and converted while generation goes on; the
        lanes stop only for the swap. Retracted requests recompute their KV under the new weights;
        ``in_place`` ones keep their (stale) KV.
        """
        async with self._update_lock:
            state = await self.prepare_weights(tensors, model_dir=model_dir, stage=stage)
            await self._swap(state, version)

    async def prepare_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                              stage: WeightStage | None = None) -> Any:
        """New weights (one source, as ``update_weights`` takes them) read, converted and placed
        like the served ones in a worker thread while generation goes on, but not served: hand
        them to ``swap_weights``, which only swaps. Raises on invalid weights."""
        def build() -> Any:  # committed like the served state, so the compiled steps take it as it is
            state = new_state(self.model, tensors=tensors, model_dir=model_dir, stage=stage)
            return self._committed(state, like=self._state)

        return await asyncio.to_thread(self._in_mesh, build)

    async def swap_weights(self, state: Any, *, version: int) -> None:
        """Serve ``state`` (from ``prepare_weights``) from the next step on: the lanes stop only
        for the swap."""
        check_swappable(self._state, state)
        async with self._update_lock:
            await self._swap(state, version)

    async def _swap(self, state: Any, version: int) -> None:
        async with self._all_lanes():
            nnx.update(self.model, state)
            self._state = state
            self._version = version

    def stage_weights(self, *, hf_layout: bool = True) -> WeightStage:
        """An empty ``WeightStage`` for the next weights of the served model, to fill part by part
        (the buckets of an HTTP push) while this version serves; then ``update_weights(stage=)``.
        ``hf_layout=False``: the kernels come in our own layout (see ``iter_hf_tensors``)."""
        return WeightStage(self.model, hf_layout=hf_layout)

    def server_info(self) -> dict[str, Any]:
        """The engine's limits under SGLang's /get_server_info names (``max_total_num_tokens``:
        the tokens the KV cache holds; ``max_req_input_len``: the longest prompt)."""
        return {"max_total_num_tokens": self.cfg.num_slots * self.max_seq_len, "page_size": 1,
                "max_running_requests": self.cfg.num_slots, "context_length": self.max_seq_len,
                "max_req_input_len": self.max_seq_len - 1, "chunked_prefill_size": self.cfg.chunked_prefill_size,
                "disable_radix_cache": not self.cfg.share_prompts, "kv_cache": "slots"}

    @property
    def state(self) -> Any:
        """The served model's ``nnx.State``: the tree, dtypes and shardings ``set_state`` wants."""
        return self._state

    def placement(self) -> dict[str, Any]:
        """Where the served weights and the KV cache live, as JSON (for /get_server_info): the
        mesh's axis sizes, and each parameter's and the first lane's cache arrays' (stacked over
        layers) partition spec and per-device shape; ``{"mesh": None}`` on one device."""
        if self.mesh is None:
            return {"mesh": None}
        cache = self._lanes[0].cache
        return {"mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
                "params": _placement(self._state),
                "kv_cache": {} if cache is None else _placement({"k": cache.k, "v": cache.v})}

    async def set_state(self, state: Any, *, version: int) -> None:
        """Serve ``state`` (device arrays already on this engine's shardings and dtypes, e.g. an
        in-process trainer's params handed over) as ``version``, swapped in between steps. The
        arrays are used as they are, not copied: whoever made them must not delete them while
        they are served. A tree, shape, dtype or sharding that differs raises before any change."""
        check_swappable(self._state, state)
        async with self._update_lock, self._all_lanes():
            nnx.update(self.model, state)
            self._state = state
            self._version = version

    async def flush_cache(self) -> bool:
        """Zero the KV cache in place (its buffers are donated, so no second cache is allocated);
        refused (False) while requests are running or waiting."""
        async with self._all_lanes():
            if self.num_running or self.num_waiting:
                return False
            for lane in self._lanes:
                lane.cache = await asyncio.to_thread(self._run_zero, lane.cache)
            return True

    def _run_zero(self, cache: Any) -> Any:
        shardings = jax.tree.map(lambda x: x.sharding, cache)
        with activate(self.mesh):
            zeroed = self._zero_fn(cache)
        # jit outputs are uncommitted; the steps are compiled for committed inputs (no copy here)
        return jax.tree.map(jax.device_put, zeroed, shardings)

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

    # -- bookkeeping --

    def _snapshot(self, seq: _Seq, start: int = 0, end: int | None = None) -> GenerateOutput:
        """The request's output tokens ``[start:end]`` (all by default)."""
        part = slice(start, end)
        return GenerateOutput(seq.req.rid, len(seq.req.input_ids), seq.out_ids[part], seq.logprobs[part],
                              seq.versions[part], seq.finish_reason, self._version,
                              seq.tops[part] if seq.req.sampling.top_logprobs_num else None)

    def _release(self, seq: _Seq) -> None:
        if seq.lane is not None:
            seq.lane.slots[seq.slot] = None
            seq.lane = seq.slot = None

    def _finish(self, seq: _Seq, reason: dict) -> None:
        seq.finish_reason = reason
        self._release(seq)
        self._waiting.pop(seq.stream_id, None)
        if self._live.get(seq.req.rid) is seq:
            del self._live[seq.req.rid]
        self.stats["finished_requests"] += 1
        if not seq.done.done():
            seq.done.set_result(self._snapshot(seq))
        if seq.updated is not None:
            seq.updated.set()

    def _abort_seq(self, seq: _Seq, message: str, status_code: int | None = None) -> bool:
        """End one request with an abort, wherever it is (O(1)); False if it had finished. A
        ``status_code`` (SGLang's field) marks an error rather than a pause or a cancel."""
        if seq.finish_reason is not None:
            return False
        reason: dict[str, Any] = {"type": "abort", "message": message}
        if status_code is not None:
            reason["status_code"] = status_code
        self._finish(seq, reason)
        return True

    def _abort_where(self, pred: Any, message: str, status_code: int | None = None) -> int:
        hits = [s for s in self._live.values() if pred(s)]
        for seq in hits:
            self._abort_seq(seq, message, status_code)
        return len(hits)

    def _append(self, seq: _Seq, token: int, logprob: float, version: int, top_values: Any = None,
                top_ids: Any = None) -> bool:
        """Record one sampled token (and the likeliest ones beside it); finish the request if it
        stops here. True when finished."""
        seq.out_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        n = seq.req.sampling.top_logprobs_num
        if n:
            seq.tops.append([(float(v), int(t)) for v, t in zip(top_values[:n], top_ids[:n], strict=True)])
        self.stats["generated_tokens"] += 1
        sp = seq.req.sampling
        if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, {"type": "stop", "matched": token})
        elif len(seq.out_ids) >= sp.max_new_tokens or seq.length >= self.max_seq_len:
            self._finish(seq, {"type": "length", "length": len(seq.out_ids)})
        return seq.finish_reason is not None

    # -- the lane loops --

    def _in_mesh(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        with activate(self.mesh):
            return fn(*args, **kwargs)

    def _committed(self, tree: Any, like: Any = None) -> Any:
        """``tree`` committed to fixed shardings (those of ``like``, if given). Compiled steps are
        cached by input sharding and commitment, so every call must see the same ones."""
        if like is not None:
            return jax.tree.map(lambda x, old: jax.device_put(x, old.sharding), tree, like)
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding if self.mesh is not None else single), tree)

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

    async def _loop(self, lane: _Lane) -> None:
        while True:
            if not self._can_step(lane):
                lane.wake.clear()
                await lane.wake.wait()
                continue
            async with lane.lock:
                try:
                    if self._paused is not None:
                        continue
                    await self._round(lane)
                except Exception as e:  # a failed step must not hang its requests
                    self._recover(lane, e)  # raising here ends the lane

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

    def _lane_ended(self, task: asyncio.Task) -> None:
        """A lane's loop ends only when ``stop`` cancels it; anything else kills the engine: every
        request fails now (HTTP 500 at a server) and new ones are refused, rather than waiting
        for a lane that is gone."""
        if task.cancelled() or not self._running or self._error is not None:
            return
        err = task.exception() or RuntimeError(f"{task.get_name()} ended")
        log.critical("engine dead: %s: %r", task.get_name(), err, exc_info=err)
        self._error = err
        self._abort_where(lambda s: True, f"engine dead: {err!r}", status_code=500)
        for waiter in self._dead_waiters:
            if not waiter.done():
                waiter.set_result(None)

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

    def _notify(self, seq: _Seq) -> None:
        if seq.updated is not None:
            seq.updated.set()

    async def _timed(self, stat: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker thread, its seconds added to ``stats[stat]``."""
        t0 = time.perf_counter()
        out = await asyncio.to_thread(fn, *args, **kwargs)
        self.stats[stat] += time.perf_counter() - t0
        return out

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


def _tokens_key(seq: _Seq) -> tuple[int, ...]:
    """The tokens a request's next prefill writes: its prompt and what it has generated so far."""
    return (*seq.req.input_ids, *seq.out_ids)


def _placement(tree: Any) -> dict[str, dict[str, list]]:
    """Each array of ``tree`` by dotted path: its partition spec and the shape each device holds."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        name = ".".join(str(k) for k in keys if k != "value")  # nnx.Param's .value is not part of the name
        spec = getattr(x.sharding, "spec", ())
        out[name] = {"spec": [list(a) if isinstance(a, tuple) else a for a in spec],
                     "shard_shape": list(x.sharding.shard_shape(x.shape))}
    return out
