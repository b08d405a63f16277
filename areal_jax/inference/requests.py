"""What the engines know of one request, and of one group of KV slots: ``_Seq`` (a request's
tokens, logprobs, per-token versions, where it runs, its future and stream event), ``_Lane`` (a
group of slots with its own cache, lock and loop task) and ``_SamplingRows`` (a call's per-row
sampling arrays). Shared by the slot engine (``inference.engine``) and the paged one
(``inference.paged``) through the engine API in ``inference.base``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.inference.steps import DEVICE_STOP_IDS, SlotState
from areal_jax.inference.types import GenerateRequest

if TYPE_CHECKING:
    from areal_jax.inference.base import EngineBase


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
    cached: int = 0
    """Prompt tokens read from another request's keys and values at its first admission."""
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

    def fill(self, i: int, seq: _Seq, engine: EngineBase, *, sampled_here: bool) -> None:
        """Row ``i`` for ``seq``. ``remaining`` counts the tokens the decode chunks may sample:
        one fewer when this call samples the request's next token itself (a prefill)."""
        sp = seq.req.sampling
        # a top_k past the vocabulary keeps every token, as -1 does (and fits the int32 row)
        self.temperature[i], self.top_p[i] = sp.temperature, sp.top_p
        self.top_k[i] = -1 if sp.top_k >= engine.vocab_size else sp.top_k
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


def _tokens_key(seq: _Seq) -> tuple[int, ...]:
    """The tokens a request's next prefill writes: its prompt and what it has generated so far."""
    return (*seq.req.input_ids, *seq.out_ids)
