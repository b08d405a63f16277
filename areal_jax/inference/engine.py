"""The generation engine: continuous batching over fixed KV slots, driven by one asyncio task.

Requests wait in a FIFO queue and enter as soon as a slot frees: waiting prompts are prefilled
together (rows padded to a length bucket, each row written into its own slot), then one compiled
call advances every slot by ``decode_steps`` tokens, attending only up to a bucketed live length.
Each compiled call runs in a worker thread (``asyncio.to_thread``), so the event loop that owns the
engine (an HTTP server, say) stays responsive. All scheduling state lives on the event loop and
changes only under ``_lock``, which a step holds from launch to the bookkeeping of its result.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.inference.steps import SlotState, bucket, compile_steps
from areal_jax.inference.types import GenerateOutput, GenerateRequest
from areal_jax.models.decoder import CACHE_AXES, Decoder
from areal_jax.models.hf_io import assign_hf_tensors, load_pretrained
from sharding import activate, logical_to_sharding

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out


def default_prefill_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two from 16, capped by ``max_seq_len`` (which is always the last bucket)."""
    return tuple(_powers_of_two(16, max_seq_len)) + (max_seq_len,)


def default_kv_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two up to a stride of ``max_seq_len / 8``, then multiples of that stride.

    Attention cost follows the attended length, so the stride keeps the waste under 1/8 of the
    cache for long sequences while the count stays around ten.
    """
    stride = max(16, -(-max_seq_len // 8 // 16) * 16)
    small = _powers_of_two(16, stride)
    return tuple(sorted({*small, *range(stride, max_seq_len, stride), max_seq_len}))


@dataclass
class EngineConfig:
    """Sizes and scheduling knobs of one engine."""

    num_slots: int = 32
    """KV slots = most requests decoded at once. The decode batch is always this many rows."""
    max_seq_len: int = 1024
    """Prompt plus output tokens per request; the KV cache holds this many positions per slot."""
    prefill_buckets: tuple[int, ...] | None = None
    """Padded prompt lengths a prefill compiles for; None derives them from ``max_seq_len``."""
    kv_buckets: tuple[int, ...] | None = None
    """Attended lengths a decode chunk compiles for; None derives them from ``max_seq_len``."""
    max_prefill_batch: int = 8
    """Most prompts prefilled in one call; rows are padded to a power of two up to this."""
    max_prefill_tokens: int = 8192
    """Most padded tokens (rows x bucket) in one prefill call; one prompt always fits."""
    decode_steps: int = 8
    """Tokens per decode call (a scan on device). More amortises dispatch and host sync; a slot
    whose request stops inside a chunk idles for the chunk's rest, and admission waits for it."""
    seed: int = 0
    """Seed of requests that bring none (each gets its own stream from a request counter)."""
    cache_dtype: str | None = None
    """KV cache dtype; None uses the model's compute dtype."""

    def __post_init__(self) -> None:
        self.prefill_buckets = tuple(sorted(self.prefill_buckets or default_prefill_buckets(self.max_seq_len)))
        self.kv_buckets = tuple(sorted(self.kv_buckets or default_kv_buckets(self.max_seq_len)))
        if self.prefill_buckets[-1] > self.max_seq_len or self.kv_buckets[-1] > self.max_seq_len:
            raise ValueError(f"buckets {self.prefill_buckets} / {self.kv_buckets} exceed "
                             f"max_seq_len={self.max_seq_len}")
        if self.max_prefill_batch < 1 or self.decode_steps < 1 or self.num_slots < 1:
            raise ValueError("num_slots, max_prefill_batch and decode_steps must be >= 1")

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        return tuple(_powers_of_two(1, self.max_prefill_batch)) + (self.max_prefill_batch,)


@dataclass(eq=False)
class _Seq:
    req: GenerateRequest
    stream_id: int
    out_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    slot: int | None = None
    done: asyncio.Future | None = None
    updates: asyncio.Queue | None = None

    @property
    def length(self) -> int:
        return len(self.req.input_ids) + len(self.out_ids)


class Engine:
    """Continuous-batching generation over a ``Decoder`` (see the module docstring)."""

    def __init__(self, model: Decoder, cfg: EngineConfig, *, eos_token_ids: list[int] | None = None,
                 mesh: Mesh | None = None, version: int = 0):
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self._version = version
        self.eos_token_ids = set(model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._graphdef, state = nnx.split(model)
        self._state = self._committed(state)
        self.prefill_fn, self.decode_fn = compile_steps(self._graphdef)
        self._cache, self._slot_state = self._fresh_cache()
        self._slots: list[_Seq | None] = [None] * cfg.num_slots
        self._waiting: deque[_Seq] = deque()
        self._counter = itertools.count(1)
        self._paused: str | None = None
        self._task: asyncio.Task | None = None
        self._lock: asyncio.Lock | None = None
        self._wake: asyncio.Event | None = None
        self.stats = {"prefill_calls": 0, "decode_calls": 0, "decode_tokens": 0}

    # -- properties --

    @property
    def version(self) -> int:
        return self._version

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.cfg.max_seq_len

    @property
    def paused(self) -> str | None:
        """The pause mode in force, or None while running."""
        return self._paused

    # -- lifecycle --

    async def start(self) -> None:
        if self._task is not None:
            return
        self._lock, self._wake = asyncio.Lock(), asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        """Finish the step in flight, abort every request, and end the loop."""
        if self._task is None:
            return
        task, self._task = self._task, None
        async with self._lock:
            task.cancel()
            self._abort_where(lambda s: True, "engine stopped")
        try:
            await task
        except asyncio.CancelledError:
            pass

    # -- requests --

    def _admit(self, req: GenerateRequest, streaming: bool) -> _Seq:
        if self._task is None:
            raise RuntimeError("Engine.start() has not been awaited")
        req.sampling.validate(self.vocab_size)
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids is empty")
        if n >= self.cfg.max_seq_len:
            raise ValueError(f"prompt of {n} tokens does not fit: prompt + output must be at most "
                             f"max_seq_len={self.cfg.max_seq_len} tokens")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        seq = _Seq(req, next(self._counter), done=asyncio.get_running_loop().create_future(),
                   updates=asyncio.Queue() if streaming else None)
        if req.sampling.max_new_tokens == 0:
            self._finish(seq, {"type": "length", "length": 0})
        else:
            self._waiting.append(seq)
            self._wake.set()
        return seq

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Run ``req`` to completion; cancelling the caller aborts the request."""
        seq = self._admit(req, streaming=False)
        try:
            return await asyncio.shield(seq.done)
        except asyncio.CancelledError:
            self._abort_where(lambda s: s is seq, "client cancelled")
            raise

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yield cumulative outputs as tokens arrive (one per step); the last one is finished."""
        seq = self._admit(req, streaming=True)
        try:
            while True:
                out = await seq.updates.get()
                yield out
                if out.finished:
                    return
        finally:
            if seq.finish_reason is None:
                self._abort_where(lambda s: s is seq, "client cancelled")

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (by rid) or all; they return their partial output. Returns how many."""
        async with self._lock:
            return self._abort_where(lambda s: abort_all or s.req.rid == rid, "aborted")

    async def pause(self, mode: str = "abort") -> None:
        """Stop stepping after the step in flight. ``abort``: every request returns now (partial
        output); ``retract``: running requests go back to the queue front and, after resume,
        recompute their KV and continue; ``in_place``: slots and KV stay as they are."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._paused = mode
        async with self._lock:
            if mode == "abort":
                self._abort_where(lambda s: True, "paused with mode abort")
            elif mode == "retract":
                running = sorted((s for s in self._slots if s is not None), key=lambda s: s.stream_id)
                for seq in reversed(running):
                    self._slots[seq.slot] = seq.slot = None
                    self._waiting.appendleft(seq)

    async def resume(self) -> None:
        self._paused = None
        self._wake.set()

    async def update_weights(self, tensors: dict[str, np.ndarray] | None = None, *,
                             model_dir: str | None = None, version: int) -> None:
        """Swap in new weights: HF-named ``tensors`` (any subset) or a whole HF ``model_dir``.

        Nothing changes unless every tensor is valid; on error the old weights keep serving and
        the error is raised. Retracted requests recompute their KV under the new weights;
        ``in_place`` ones keep their (stale) KV.
        """
        if (tensors is None) == (model_dir is None):
            raise ValueError("update_weights needs exactly one of tensors or model_dir")
        async with self._lock:
            if tensors is not None:
                await asyncio.to_thread(self._in_mesh, assign_hf_tensors, self.model, tensors)
            else:
                await asyncio.to_thread(self._load_dir, model_dir)
            self._state = self._committed(nnx.state(self.model), like=self._state)
            self._version = version

    def _load_dir(self, model_dir: str) -> None:
        cfg = self.model.config
        new = load_pretrained(model_dir, mesh=self.mesh, param_dtype=cfg.param_dtype, dtype=cfg.dtype)
        old_state, new_state = nnx.state(self.model), nnx.state(new)
        describe = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
        if jax.tree.structure(old_state) != jax.tree.structure(new_state) or describe(old_state) != describe(new_state):
            raise ValueError(f"{model_dir}: parameters differ in names or shapes from the served model")
        nnx.update(self.model, new_state)

    async def flush_cache(self) -> bool:
        """Zero the KV cache; refused (False) while requests are running or waiting."""
        async with self._lock:
            if self.num_running or self.num_waiting:
                return False
            self._cache, self._slot_state = await asyncio.to_thread(self._fresh_cache)
            return True

    # -- bookkeeping --

    def _snapshot(self, seq: _Seq) -> GenerateOutput:
        return GenerateOutput(seq.req.rid, len(seq.req.input_ids), list(seq.out_ids), list(seq.logprobs),
                              list(seq.versions), seq.finish_reason, self._version)

    def _finish(self, seq: _Seq, reason: dict) -> None:
        seq.finish_reason = reason
        if seq.slot is not None:
            self._slots[seq.slot] = seq.slot = None
        out = self._snapshot(seq)
        if not seq.done.done():
            seq.done.set_result(out)
        if seq.updates is not None:
            seq.updates.put_nowait(out)

    def _abort_where(self, pred: Any, message: str) -> int:
        hits = [s for s in self._waiting if pred(s)] + [s for s in self._slots if s is not None and pred(s)]
        if hits:
            self._waiting = deque(s for s in self._waiting if not pred(s))
            for seq in hits:
                self._finish(seq, {"type": "abort", "message": message})
        return len(hits)

    def _append(self, seq: _Seq, token: int, logprob: float, version: int) -> bool:
        """Record one sampled token; finish the request if it stops here. True when finished."""
        seq.out_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        sp = seq.req.sampling
        if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, {"type": "stop", "matched": token})
        elif len(seq.out_ids) >= sp.max_new_tokens or seq.length >= self.cfg.max_seq_len:
            self._finish(seq, {"type": "length", "length": len(seq.out_ids)})
        return seq.finish_reason is not None

    # -- the loop --

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
        with activate(self.mesh):
            dtype = self.cfg.cache_dtype and np.dtype(self.cfg.cache_dtype)
            cache = self.model.init_cache(self.cfg.num_slots, self.cfg.max_seq_len, dtype)
            state = SlotState.empty(self.cfg.num_slots)
            if self.mesh is not None:
                cache = jax.device_put(cache, logical_to_sharding(CACHE_AXES, self.mesh))
                state = jax.device_put(state, logical_to_sharding((None,), self.mesh))
        return self._committed(cache), self._committed(state)

    def _can_step(self) -> bool:
        if self._paused is not None:
            return False
        return self.num_running > 0 or (bool(self._waiting) and None in self._slots)

    async def _loop(self) -> None:
        while True:
            if not self._can_step():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self._lock:
                try:
                    if self._paused is not None:
                        continue
                    if self._waiting and None in self._slots:
                        await self._prefill()
                    elif self.num_running:
                        await self._decode()
                except Exception as e:  # a failed step must not hang its requests
                    log.exception("engine step failed")
                    self._abort_where(lambda s: s.slot is not None, f"engine error: {e!r}")
                    self._cache, self._slot_state = self._fresh_cache()

    async def _prefill(self) -> None:
        cfg = self.cfg
        free = [i for i, s in enumerate(self._slots) if s is None]
        batch: list[_Seq] = []
        while self._waiting and len(batch) < min(len(free), cfg.max_prefill_batch):
            longest = max([s.length for s in batch] + [self._waiting[0].length])
            if batch and (len(batch) + 1) * bucket(longest, cfg.prefill_buckets) > cfg.max_prefill_tokens:
                break
            batch.append(self._waiting.popleft())
        length = bucket(max(s.length for s in batch), cfg.prefill_buckets)
        rows = bucket(len(batch), cfg.prefill_rows)
        ids = np.zeros((rows, length), np.int32)
        lengths = np.zeros((rows,), np.int32)
        slots = np.full((rows,), cfg.num_slots, np.int32)  # padding rows write nowhere
        first_step = np.zeros((rows,), np.int32)
        temp, top_p = np.ones((rows,), np.float32), np.ones((rows,), np.float32)
        top_k = np.full((rows,), -1, np.int32)
        seed, stream = np.zeros((rows,), np.uint32), np.zeros((rows,), np.uint32)
        for i, seq in enumerate(batch):
            toks = seq.req.input_ids + seq.out_ids
            ids[i, :len(toks)] = toks
            lengths[i], slots[i], first_step[i] = len(toks), free[i], len(seq.out_ids)
            sp = seq.req.sampling
            temp[i], top_p[i], top_k[i] = sp.temperature, sp.top_p, sp.top_k
            seed[i], stream[i] = (sp.seed, 0) if sp.seed is not None else (cfg.seed, seq.stream_id)
            seq.slot = free[i]
            self._slots[free[i]] = seq
        version = self._version
        self._cache, self._slot_state, out = await asyncio.to_thread(
            self._run_step, self.prefill_fn, self._state, self._cache, self._slot_state, ids, lengths, slots,
            first_step, temp, top_p, top_k, seed, stream)
        self.stats["prefill_calls"] += 1
        for i, seq in enumerate(batch):
            if self._slots[free[i]] is seq:  # not aborted or retracted meanwhile
                self._append(seq, int(out[0, i]), float(out[1, i]), version)
                self._notify(seq)

    async def _decode(self) -> None:
        n = self.cfg.decode_steps
        live = [s for s in self._slots if s is not None]
        kv_len = bucket(max(s.length - 1 for s in live) + n, self.cfg.kv_buckets)
        version = self._version
        self._cache, self._slot_state, out = await asyncio.to_thread(
            self._run_step, self.decode_fn, self._state, self._cache, self._slot_state, kv_len=kv_len, num_steps=n)
        self.stats["decode_calls"] += 1
        tokens, logprobs = out[0].astype(np.int64).tolist(), out[1].tolist()
        for seq in live:
            if seq.slot is None:
                continue
            slot = seq.slot
            for i in range(n):
                self.stats["decode_tokens"] += 1
                if self._append(seq, tokens[i][slot], logprobs[i][slot], version):
                    break
            self._notify(seq)

    def _notify(self, seq: _Seq) -> None:
        if seq.updates is not None and seq.finish_reason is None:
            seq.updates.put_nowait(self._snapshot(seq))

    def _run_step(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, SlotState, np.ndarray]:
        with activate(self.mesh):
            cache, state, out = fn(*args, **kwargs)
            return cache, state, np.asarray(jax.device_get(out))
