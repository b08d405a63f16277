"""The engines' request bookkeeping: taking a request in (its checks, its record, the queue),
recording each sampled token with its version, and ending a request (finished, stopped or
aborted) with the output its caller or stream reader gets. A mixin of ``inference.base.EngineBase``,
which owns the queue, the record of live requests and the lanes; it runs on the engine's event loop
(no locks: a request's record changes only there)."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, OrderedDict
from typing import Any

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.requests import _Seq
from areal_jax.inference.types import (
    DuplicateRequestError,
    EngineDeadError,
    GenerateOutput,
    GenerateRequest,
    QueueFullError,
)

__all__ = ["RequestBookkeeping"]


class RequestBookkeeping:
    """``EngineBase``'s request records (see the module docstring)."""

    cfg: EngineConfig
    eos_token_ids: set[int]
    stats: dict[str, Any]
    tokens_by_version: Counter[int]
    _version: int
    _running: bool
    _error: BaseException | None
    _waiting: OrderedDict[int, _Seq]
    _live: dict[str, _Seq]
    _counter: itertools.count
    num_waiting: int
    vocab_size: int
    max_seq_len: int
    _wake_all: Any  # EngineBase's: wake every lane's loop

    def _admit(self, req: GenerateRequest, streaming: bool) -> _Seq:
        """Check ``req`` (each refusal names the field and the fix) and take it in: its record,
        finished at once when it asks for no token, else queued and the lanes woken."""
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

    def _snapshot(self, seq: _Seq, start: int = 0, end: int | None = None) -> GenerateOutput:
        """The request's output tokens ``[start:end]`` (all by default)."""
        part = slice(start, end)
        return GenerateOutput(seq.req.rid, len(seq.req.input_ids), seq.out_ids[part], seq.logprobs[part],
                              seq.versions[part], seq.finish_reason, self._version,
                              seq.tops[part] if seq.req.sampling.top_logprobs_num else None, seq.cached)

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
        self.tokens_by_version[version] += 1
        sp = seq.req.sampling
        if token in (sp.stop_token_ids or ()) or (not sp.ignore_eos and token in self.eos_token_ids):
            self._finish(seq, {"type": "stop", "matched": token})
        elif len(seq.out_ids) >= sp.max_new_tokens or seq.length >= self.max_seq_len:
            self._finish(seq, {"type": "length", "length": len(seq.out_ids)})
        return seq.finish_reason is not None

    def _notify(self, seq: _Seq) -> None:
        if seq.updated is not None:
            seq.updated.set()
