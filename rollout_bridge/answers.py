"""One answer across its re-sends, and the replies it is made of.

An answer the client asks for may take several ``/generate`` requests: after an abort (a weight
update paused the server), a dead server or a timeout it is re-sent as prompt + tokens so far
with the budget left. ``Answer`` keeps what the attempts produced (tokens, logprobs, the version
of each token) and builds the next attempt's request; the functions below read one reply or a
batch's replies in the shapes SGLang sends, and say how long to back off. The routing of
attempts to servers is ``rollout_bridge.client``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

from rollout_bridge import protocol as P
from rollout_bridge.records import RolloutError


@dataclass
class GenerateResult:
    """One finished answer. ``output_versions[i]`` is the policy version that sampled token i."""

    rid: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: dict[str, Any]
    text: str = ""
    """The servers' text of every segment, joined (a character split across a re-send may show
    as two replacement characters; ``output_ids`` are exact)."""
    resends: int = 0
    """How many times the request was re-sent (after an abort or a dead server)."""


IMMEDIATE_IDLE_RESENDS = 2
"""Aborts in a row that brought an answer no new token, re-sent at once before the client backs
off. A pause aborts the requests still queued on the server as well as the running ones (SGLang's
``abort`` mode does), and a controller submits new groups just when a weight update frees
capacity, so an answer that comes back empty from one pause is routine, not a server in trouble."""


def abort_backoff_s(idle: int) -> float:
    """Seconds to wait before re-sending an answer whose last ``idle`` attempts were aborted with
    no new token: none for the first ``IMMEDIATE_IDLE_RESENDS``, then 0.05 s, doubling up to 1 s,
    so that a server that keeps aborting without progress is backed off, not hammered."""
    if idle <= IMMEDIATE_IDLE_RESENDS:
        return 0.0
    return min(0.05 * 2 ** min(idle - IMMEDIATE_IDLE_RESENDS - 1, 5), 1.0)


async def first_of(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


async def sleep_or_wake(wake: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds`` (a back-off), or less if ``abort`` stops an answer meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)


def rids_for(prompts: list[list[int]], rids: list[str] | None) -> list[str | None]:
    """``rids``, checked to give one per prompt (None: each gets its own)."""
    if rids is None:
        return [None] * len(prompts)
    if len(rids) != len(prompts):
        raise ValueError(f"rids has {len(rids)} entries for {len(prompts)} prompts")
    return list(rids)


class Answer:
    """One answer being generated: its prompt, budget, the tokens so far and their versions."""

    def __init__(self, input_ids: list[int], sampling_params: dict[str, Any] | None, rid: str | None):
        self.sp = dict(sampling_params or {})
        self.budget = int(self.sp.get("max_new_tokens", P.SamplingParams().max_new_tokens))
        self.rid = rid or uuid.uuid4().hex
        self.prompt = list(input_ids)
        self.out: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.text = ""
        self.finish: dict[str, Any] = {"type": "length", "length": self.budget}
        self.attempt = self.idle = 0
        self.done = self.cancelled = False
        self.wake: asyncio.Event | None = None

    def next_part(self) -> dict[str, Any]:
        """The next attempt's request: prompt + tokens so far, with the budget left."""
        sub = self.rid if self.attempt == 0 else f"{self.rid}-r{self.attempt}"
        self.attempt += 1
        return {"input_ids": self.prompt + self.out, "rid": sub, "return_logprob": True, "stream": False,
                "sampling_params": {**self.sp, "max_new_tokens": self.budget - len(self.out)}}

    def take(self, ids: list[int], lps: list[float], versions: list[int], text: str, finish: dict[str, Any]) -> None:
        self.out += ids
        self.logprobs += lps
        self.versions += versions
        self.text += text
        self.finish = finish

    def result(self) -> GenerateResult:
        finish = self.finish
        if finish.get("type") == "length" or (finish.get("type") == "abort" and len(self.out) >= self.budget):
            finish = {"type": "length", "length": len(self.out)}
        return GenerateResult(rid=self.rid, input_ids=self.prompt, output_ids=self.out,
                              output_logprobs=self.logprobs, output_versions=self.versions, finish_reason=finish,
                              text=self.text, resends=self.attempt - 1)


def replies(body: Any, subs: list[str]) -> list[dict[str, Any]] | None:
    """The replies of one /generate, one per request sent (``subs``, their rids), in that order:
    a dict for the single form, a list for the batch form (matched by ``meta_info.id`` when every
    reply has one, else by position). None when the body is not that."""
    if len(subs) == 1 and isinstance(body, dict):
        return [body]
    if not isinstance(body, list) or len(body) != len(subs) or not all(isinstance(r, dict) for r in body):
        return None
    by_id = {(r.get("meta_info") or {}).get("id"): r for r in body}
    if set(by_id) == set(subs):
        return [by_id[s] for s in subs]
    return body


def retry_after(headers: dict[str, str], default: float) -> float:
    try:
        return min(max(float(headers.get("Retry-After", "")), 0.0), 60.0)
    except ValueError:
        return default


def parse_reply(body: dict[str, Any]) -> tuple[list[int], list[float], dict[str, Any]]:
    """Tokens, logprobs and finish reason of one /generate reply."""
    meta = body.get("meta_info") or {}
    entries = meta.get("output_token_logprobs") or []
    ids = body.get("output_ids")
    if ids is None:  # old servers: token ids only inside the logprob entries
        ids = [int(e[1]) for e in entries]
    ids = [int(t) for t in ids]
    lps = [float(e[0]) if e[0] is not None else float("nan") for e in entries]
    if len(lps) != len(ids):
        raise RolloutError(f"reply {meta.get('id')}: {len(ids)} output_ids but {len(lps)} logprobs")
    finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}
    if isinstance(finish, str):
        finish = {"type": finish}
    return ids, lps, finish
