"""The rollout client: asks inference servers (real SGLang or our embedded JAX server) for answers.

``RolloutClient`` is the interface the controller sees; ``HttpRolloutClient`` drives any number
of servers over HTTP. A generation that comes back aborted (a weight update paused the server)
or whose server died is re-sent, to the same server or another, as prompt + tokens so far with
the remaining token budget, until it stops or reaches its length; every token keeps the version
that produced it. Control calls (pause, weight updates, continue, flush) fan out to all servers
concurrently. Every call has a timeout; a generation that times out is aborted on its server
before it is re-sent elsewhere, and a full server (503) is backed off, not marked down. A server
error (another 5xx, or an abort with a 5xx status) is re-sent at most ``max_error_resends`` times
with a doubling wait, and leaves the server in rotation. An answer's state across its attempts,
and the reading of replies, are ``rollout_bridge.answers``'.

Versions: the client keeps its own record of which policy version each server holds, because it
pushed them (``update_weights_from_disk``, ``push_tensor_bucket``, ``update_weight_version``). A
server's ``weight_version`` is an opaque label (stock SGLang says "default"): it is only compared
with the labels this client gave that server. Each answer segment's tokens are stamped with the
version their reply's labels prove, where the server keeps labels, else from the record; a reply
proving older weights than the record (a restart) has that server's version checked at once.
A server that went back to older weights is kept out of rotation until it holds the current
version again: re-loaded at once from the last disk checkpoint when there is one, else at the
next push.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any

import aiohttp

from rollout_bridge import protocol as P
from rollout_bridge.answers import (
    IMMEDIATE_IDLE_RESENDS,
    Answer,
    GenerateResult,
    abort_backoff_s,
    first_of,
    parse_reply,
    replies,
    retry_after,
    rids_for,
    sleep_or_wake,
)
from rollout_bridge.pool import ServerPool
from rollout_bridge.records import (
    AllServersDownError,
    ClientConfig,
    RolloutError,
    ServerRecord,
    WeightUpdateError,
    reply_message,
)

__all__ = ["AllServersDownError", "ClientConfig", "GenerateResult", "HttpRolloutClient", "RolloutClient",
           "RolloutError", "WeightUpdateError", "IMMEDIATE_IDLE_RESENDS", "abort_backoff_s"]

log = logging.getLogger(__name__)


class RolloutClient(abc.ABC):
    """What the controller needs from rollout: over HTTP here, in-process in ``rollout_bridge/local.py``."""

    @abc.abstractmethod
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None, session: str | None = None) -> GenerateResult:
        """One answer. ``session``: requests that continue one conversation (an agent run's
        turns) name the same session, and a client over several servers sends them to one, where
        the prefix cache holds the turns before."""

    async def generate_many(self, prompts: list[list[int]], sampling_params: dict[str, Any] | None = None, *,
                            rids: list[str] | None = None, session: str | None = None) -> list[GenerateResult]:
        """One answer to each prompt (a group: the same prompt n times); here one ``generate``
        each, concurrently. The HTTP client sends them as one batch request."""
        return list(await asyncio.gather(*(self.generate(p, sampling_params, rid=rid, session=session)
                                           for p, rid in zip(prompts, rids_for(prompts, rids), strict=True))))

    @abc.abstractmethod
    async def pause(self, mode: str = "abort") -> None: ...

    @abc.abstractmethod
    async def continue_generation(self) -> None: ...

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, *, version: int, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...



class HttpRolloutClient(RolloutClient):
    """Generation over the servers of the ``ServerPool`` it holds (``pool``; see the module
    docstring). The pool's API (versions, health, control calls, weight pushes) is reached
    through the client too: ``client.pause(...)`` is ``client.pool.pause(...)``."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        self.pool = ServerPool(addresses, api_key=api_key, config=config)
        self._answers: dict[str, Answer] = {}
        """Answers being generated, by rid: what ``abort`` may stop."""

    def __getattr__(self, name: str) -> Any:
        if name == "pool" or name.startswith("__"):  # not set yet (or a protocol probe): no recursion
            raise AttributeError(name)
        return getattr(self.pool, name)

    @property
    def cfg(self) -> ClientConfig:
        return self.pool.cfg

    @property
    def servers(self) -> list[ServerRecord]:
        return self.pool.servers

    async def __aenter__(self) -> HttpRolloutClient:
        await self.pool.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()

    async def pause(self, mode: str = "abort") -> None:
        await self.pool.pause(mode)

    async def continue_generation(self) -> None:
        await self.pool.continue_generation()

    async def update_weights_from_disk(self, model_path: str, *, version: int, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> list[dict[str, Any]]:
        return await self.pool.update_weights_from_disk(model_path, version=version,
                                                        abort_all_requests=abort_all_requests,
                                                        flush_cache=flush_cache)

    async def flush_cache(self) -> None:
        await self.pool.flush_cache()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None, session: str | None = None) -> GenerateResult:
        """Generate until stop or length, re-sending after aborts and dead servers; ``session``
        (an agent run's turns): to the server that took the session's last request, while it is
        healthy and holds the current weights (its prefix cache holds the turns before).

        ``sampling_params`` uses SGLang's names (``max_new_tokens``, ``temperature``, ...).
        A 400 from a server is the caller's error and raises ``RolloutError`` without retrying.
        """
        return (await self._answer([Answer(input_ids, sampling_params, rid)], batch=False, session=session))[0]

    async def generate_many(self, prompts: list[list[int]], sampling_params: dict[str, Any] | None = None, *,
                            rids: list[str] | None = None, session: str | None = None) -> list[GenerateResult]:
        """One answer to each prompt, asked of one server in one /generate (SGLang's batch form:
        ``input_ids`` a list of lists), as ``generate`` would give them one by one. After an
        abort, the unfinished answers are re-sent together; with ``ClientConfig.batch_requests``
        off, each answer is its own request."""
        if not self.cfg.batch_requests or len(prompts) < 2:
            return await super().generate_many(prompts, sampling_params, rids=rids, session=session)
        return await self._answer([Answer(p, sampling_params, rid)
                                   for p, rid in zip(prompts, rids_for(prompts, rids), strict=True)], batch=True,
                                  session=session)

    async def _answer(self, answers: list[Answer], *, batch: bool, session: str | None = None) -> list[GenerateResult]:
        """Run ``answers`` to the end, all sent to one server in each attempt (one request in
        SGLang's batch form when ``batch``, else the single form for the one answer)."""
        key = answers[0].rid
        busy = errors = 0
        taken = [a.rid for a in answers if a.rid in self._answers]
        if taken:
            raise RolloutError(f"request {taken[0]} is already being generated; give each request its own rid")
        wake = asyncio.Event()  # set by ``abort``: a back-off ends early
        for a in answers:
            a.wake = wake
            self._answers[a.rid] = a
        try:
            while live := self._unfinished(answers, wake):
                for a in live:
                    if a.attempt > self.cfg.max_resends:
                        raise RolloutError(f"request {a.rid}: gave up after {self.cfg.max_resends} re-sends")
                # Not while this client has the servers paused: an answer sent now would run under
                # the weights pushed before the continue, stamped with the version before them. An
                # abort ends the wait too.
                server = None
                while live and server is None:
                    if not self.pool.continued.is_set():
                        await first_of(self.pool.continued, wake)
                    else:
                        server = await self.pool.pick(key, session)
                        if not self.pool.continued.is_set():
                            server = None
                    # aborted while paused or routing? From here to the send there is no await, so an
                    # abort either sees the request in flight (and stops it there) or is seen here.
                    live = self._unfinished(answers, wake)
                if not live:
                    break
                parts = [a.next_part() for a in live]
                subs = [p["rid"] for p in parts]
                payload = parts[0] if not batch else {
                    "input_ids": [p["input_ids"] for p in parts], "rid": subs, "return_logprob": True,
                    "stream": False, "sampling_params": [p["sampling_params"] for p in parts]}
                server.inflight.update(subs)
                sent_version, headers = server.version, {}
                epoch, clean, continues = server.updates, server.updating == 0, server.continues
                try:
                    status, body = await self.pool.request(
                        server, "POST", "/generate", json_body=payload, timeout=self.cfg.generate_timeout_s,
                        session=self.pool.gen_session, reply_headers=headers)
                except TimeoutError:
                    # The server may still be working on it: stop it there before re-sending elsewhere.
                    for sub in subs:
                        await self.pool.call_one(server, "/abort_request", {"rid": sub}, self.cfg.control_timeout_s)
                    self.pool.mark_down(server, f"/generate timed out after {self.cfg.generate_timeout_s:g}s")
                    continue
                except (aiohttp.ClientError, OSError) as e:
                    self.pool.mark_down(server, e)
                    continue
                finally:
                    server.inflight.difference_update(subs)
                if status == 503:  # full queue: wait and re-send, the server is fine
                    busy += 1
                    await sleep_or_wake(wake, retry_after(headers, self.cfg.busy_backoff_s * 2 ** min(busy - 1, 3)))
                    self.pool.sticky.pop(key, None)
                    continue
                busy = 0
                if status == 400 or status == 401:
                    raise RolloutError(f"{server.url}/generate rejected request {key} ({status}): "
                                       f"{reply_message(body)}")
                got = replies(body, subs) if status == 200 else None
                if got is None:
                    what = (f"answered {status}: {reply_message(body)}" if status != 200 else
                            f"answered a batch of {len(subs)} with {reply_message(body)[:200]}")
                    errors = await self._after_error(key, server, errors, what, wake)
                    continue
                failed, idle = None, 0
                crossed, kept = not clean or server.updates != epoch, server.kept_update > epoch
                # Crossed only by changes made under this client's pause that aborts, and answered
                # before its continue: the request ran (and was aborted) before the change, or
                # it would still be held.
                settled = (clean and server.continues == continues and server.free_update <= epoch
                           and not kept)
                for a, reply in zip(live, got, strict=True):
                    ids, lps, finish = parse_reply(reply)
                    versions = self._stamp(server, sent_version, reply.get("meta_info") or {}, len(ids),
                                           crossed=crossed and not settled, kept=kept)
                    if versions is None:  # which weights made them is unknown: make them again
                        log.info("request %s: %s answered %d tokens across a weight update without saying "
                                 "which weights made them; re-sent", a.rid, server.url, len(ids))
                        continue
                    a.take(ids, lps, versions, reply.get("text") or "", finish)
                    if finish.get("type") != "abort":
                        a.done = True
                        continue
                    code = finish.get("status_code")
                    if a.cancelled or (a.budget and len(a.out) >= a.budget):
                        a.done = True
                    elif code is not None and 400 <= int(code) < 500:
                        raise RolloutError(f"{server.url} aborted request {a.rid}: {finish.get('message')}")
                    elif code is not None and int(code) >= 500:
                        failed = f"aborted with {code}: {finish.get('message')}"
                    else:
                        # Aborted by a pause or weight update: resume with what we have, at once
                        # unless the server keeps aborting without progress (abort_backoff_s).
                        a.idle = 0 if ids else a.idle + 1
                        idle = max(idle, a.idle)
                if failed is not None:
                    errors = await self._after_error(key, server, errors, failed, wake)
                elif wait := abort_backoff_s(idle):
                    await sleep_or_wake(wake, wait)
        finally:
            for a in answers:
                self.pool.sticky.pop(a.rid, None)
                if self._answers.get(a.rid) is a:
                    del self._answers[a.rid]
        return [a.result() for a in answers]

    @staticmethod
    def _unfinished(answers: list[Answer], wake: asyncio.Event) -> list[Answer]:
        """The answers still to generate; those the caller aborted are finished as aborted."""
        for a in answers:
            if not a.done and a.cancelled:
                a.done = True
                a.finish = {"type": "abort", "message": "aborted by the client"}
        wake.clear()
        return [a for a in answers if not a.done]

    async def _after_error(self, rid: str, server: ServerRecord, errors: int, what: str, wake: asyncio.Event) -> int:
        """A server failed this request (5xx, or an abort with a 5xx status): count it, give up
        past ``max_error_resends``, else wait (doubling) and let the next attempt go round-robin.
        The server stays in rotation: one failed request does not make it dead."""
        errors += 1
        if errors > self.cfg.max_error_resends:
            raise RolloutError(f"request {rid}: {server.url}/generate {what} (gave up after {errors} server errors)")
        log.warning("request %s: %s/generate %s; re-sending (error %d of at most %d)", rid, server.url, what,
                    errors, self.cfg.max_error_resends + 1)
        self.pool.sticky.pop(rid, None)
        await sleep_or_wake(wake, min(self.cfg.error_backoff_s * 2 ** (errors - 1), 30.0))
        return errors

    def _stamp(self, server: ServerRecord, sent_version: int, meta: dict[str, Any], n: int, *,
               crossed: bool = False, kept: bool = False) -> list[int] | None:
        """Per-token versions of one reply, never other than the weights that made the tokens;
        None when they cannot be known (the caller drops the tokens and asks again).

        ``crossed``: a weight change on this server began after the request was sent, or was in
        progress then; ``kept``: one of them ran under a pause that kept the request running.
        The reply's own labels decide where they stand for a version this client gave the server
        and the server keeps labels (a reply reporting such a label proves it): per-token spans
        (``weight_versions``, our server) are exact; a single ``weight_version`` is the label
        served when the server answered (SGLang), so it bounds the tokens: all of them when
        nothing crossed, and when a change crossed, also when the label is still the one sent
        under (an answer the pause aborted) or the change could not run beside the request (a
        pause that aborts, or SGLang's update lock: the request ran wholly after it). Without a
        label, the version the server held when the segment was sent, by the client's record,
        unless a change crossed. A reply whose label proves older weights than the record has the
        server's version checked at once (``check_versions``)."""
        label = meta.get("weight_version")
        label = None if label is None else str(label)
        lv = server.labels.get(label) if label is not None else None
        spans = P.span_labels(meta, n)
        if (lv is not None and label != server.first_label) or spans is not None:
            server.keeps_labels = True  # it reports a label this client gave it, or labels per token
        if server.keeps_labels and lv is not None and lv < server.version and not crossed:
            self.pool.recheck(server)
        if spans is not None and server.keeps_labels:
            return [sent_version if lab is None else server.labels.get(lab, sent_version) for lab in spans]
        if server.keeps_labels and lv is not None:
            if crossed and kept and lv > sent_version:
                return None  # it may have run on both sides of the change
            return [lv] * n
        return None if crossed and n else [sent_version] * n

    async def abort(self, rid: str) -> None:
        """Stop one request for good: it returns what it has with an abort finish reason, whether
        it is on a server now or between two attempts (a back-off, routing). A rid not being
        generated is ignored (nothing is kept for it)."""
        a = self._answers.get(rid)
        if a is None:
            return
        a.cancelled = True
        a.wake.set()
        for s in self.servers:
            for sub in [r for r in s.inflight if r == rid or r.startswith(f"{rid}-r")]:
                await self.pool.call_one(s, "/abort_request", {"rid": sub}, self.cfg.control_timeout_s)
