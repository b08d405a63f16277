"""The engines' API: request intake, streaming, aborts, pauses, weight swaps and the lane loops,
whatever the KV cache's layout.

Requests wait in a FIFO queue (bounded by ``max_queued_requests``) until the engine's scheduler
takes them. A lane is a group of requests with its own cache and its own asyncio task; lanes share
the queue, the weights and the compiled steps, and their calls run concurrently in worker threads
(``asyncio.to_thread``), so the event loop that owns the engine (an HTTP server, say) stays
responsive. Scheduling state lives on the event loop; a lane changes its requests only under its
own lock, held from launch to the bookkeeping of the result (one ``_round`` of ``_loop``), and
engine-wide changes (pause, abort all, weight swap) take every lane's lock. Aborting or cancelling
one request takes no lock and costs O(1): the queue is keyed by request, and a step whose request
went away ignores its result. A weight update reads and converts the new weights outside the
locks and only swaps them in under them. A request's record (its checks on intake, its tokens,
how it ends) is ``inference.bookkeeping``'s.

``EngineBase`` leaves the KV layout and the device steps to a subclass (``_fresh_cache``,
``_can_step``, ``_round``, ``_recover``, ``step_shapes``, ``warmup``): the slot engine
(``inference.engine.Engine``) and the paged one (``inference.paged.PagedEngine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from areal_jax.inference.bookkeeping import RequestBookkeeping
from areal_jax.inference.config import EngineConfig
from areal_jax.inference.requests import _Lane, _Seq
from areal_jax.inference.types import GenerateOutput, GenerateRequest
from areal_jax.inference.weight_swap import WeightSwaps
from areal_jax.models.decoder import Decoder
from areal_jax.models.layer_stack import split_layers
from sharding import activate

__all__ = ["PAUSE_MODES", "EngineBase"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class EngineBase(RequestBookkeeping, WeightSwaps):
    """Continuous-batching generation over a ``Decoder`` (see the module docstring); build one
    with ``inference.engine.Engine``, which picks the KV layout from ``EngineConfig.kv_cache``."""

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self._version = version
        self.eos_token_ids = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._graphdef, state = nnx.split(model)
        # The serving layout (EngineConfig.layer_layout): each stacked layer parameter as one array
        # per layer, which the layer loop reads in place (models.layer_stack). ``self.model`` is
        # then the engine's own object in that layout; the caller's model is left as it was.
        self._state = self._committed(state)
        if cfg.layer_layout == "split":
            self._state = split_layers(self._state)
            self.model = nnx.merge(self._graphdef, self._state)
        self.max_top = max(1, min(cfg.max_top_logprobs, model.config.vocab_size))
        # at[].set writes into the donated input buffer (zeros_like would not use it, so XLA would not
        # reuse it): a flush never holds two caches.
        self._zero_fn = jax.jit(lambda cache: jax.tree.map(lambda x: x.at[:].set(0), cache), donate_argnums=0)
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
        """Seed of requests that bring none: ``cfg.seed``, or drawn at random per engine."""
        self.num_lanes = self._resolve_lanes()
        self.lane_slots = cfg.num_slots // self.num_lanes
        self._lanes = [_Lane(i, [None] * self.lane_slots) for i in range(self.num_lanes)]
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
                      "mixed_seconds": 0.0, "paused_seconds": 0.0}
        """``prefill_seconds`` and ``decode_seconds``: wall seconds from handing a compiled prefill
        (its chunks included) or decode call to the worker thread to holding its result, summed
        over lanes (so with several lanes they can add up to more than the time that passed).
        ``mixed_seconds``: the same for the paged engine's mixed calls, a prefill chunk beside the
        running answers' decode tokens (0 on the slot engine).
        ``paused_seconds``: wall seconds between each ``pause`` and the ``resume`` after it, the
        time weight updates keep the engine from generating."""
        self._paused_at = 0.0
        self.tokens_by_version: Counter[int] = Counter()
        """Tokens sampled under each engine version (what the per-token stamps said), e.g. to check
        that every engine of a pod served each pushed version."""

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

    async def _timed(self, stat: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a worker thread, its seconds added to ``stats[stat]``."""
        t0 = time.perf_counter()
        out = await asyncio.to_thread(fn, *args, **kwargs)
        self.stats[stat] += time.perf_counter() - t0
        return out

    # -- what an engine's KV layout defines (the slot engine: ``inference.engine``; the paged one:
    # ``inference.paged``) --

    def _fresh_cache(self) -> tuple[Any, Any]:
        """A zero KV cache for one lane, and its device-side state (or None)."""
        raise NotImplementedError

    def _can_step(self, lane: _Lane) -> bool:
        """Whether ``lane``'s loop has work now (else it sleeps until woken)."""
        raise NotImplementedError

    async def _round(self, lane: _Lane) -> None:
        """One round of ``lane``'s loop, under its lock: admit, prefill, decode."""
        raise NotImplementedError

    def _recover(self, lane: _Lane, e: Exception) -> None:
        """After a failed round: fail the requests it touched and give ``lane`` a fresh cache."""
        raise NotImplementedError

    def step_shapes(self) -> list[tuple[str, int, int, int]]:
        """The compiled-step shapes ``warmup`` compiles."""
        raise NotImplementedError

    def warmup(self, stop: threading.Event | None = None) -> int:
        """Compile ``step_shapes`` before ``start()``; returns how many (fewer once ``stop`` is set)."""
        raise NotImplementedError
