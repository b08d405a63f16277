"""The set of inference servers a rollout client talks to: sessions, health, routing, the record
of which policy version each server holds, and the control calls that fan out to all of them.

Versions: the pool keeps its own record of which policy version each server holds, because it
pushed them (``update_weights_from_disk``, ``push_tensor_bucket``, ``update_weight_version``). A
server's ``weight_version`` is an opaque label (stock SGLang says "default"): it is only compared
with the labels this pool gave that server, to notice a server that went back to older weights (a
restart). Such a server is kept out of rotation until it holds the current version again:
re-loaded at once from the last disk checkpoint when there is one, else at the next push.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from rollout_bridge import protocol as P

log = logging.getLogger("rollout_bridge.client")

KEEPING_PAUSE_MODES = ("in_place", "retract")
"""Pause modes that keep the requests running on the server (SGLang's): a weight change under one
can give a request tokens of both weights."""


class RolloutError(RuntimeError):
    """A generation or control call that cannot succeed; the message says which server and why."""


class AllServersDownError(RolloutError):
    pass


class WeightUpdateError(RolloutError):
    """A weight update some servers refused; ``failed`` maps each one's URL to its answer."""

    def __init__(self, message: str, failed: dict[str, str] | None = None):
        super().__init__(message)
        self.failed = dict(failed or {})



@dataclass
class ClientConfig:
    """Timeouts and retry policy of ``HttpRolloutClient``."""

    generate_timeout_s: float = 3600.0
    """Upper bound on one /generate call (one attempt, not the whole resumed answer)."""
    control_timeout_s: float = 60.0
    """Pause, continue, abort, flush, info, health."""
    weight_timeout_s: float = 1800.0
    """/update_weights_from_disk and each bucket of /update_weights_from_tensor."""
    connect_timeout_s: float = 10.0
    health_interval_s: float = 5.0
    """Period of the background health check started by ``start()``."""
    all_down_wait_s: float = 30.0
    """How long a request waits for some server to come back before ``AllServersDownError``."""
    max_resends: int = 1000
    """Bound on re-sends of one request (aborts, failovers and refusals by a full server)."""
    max_error_resends: int = 3
    """Re-sends of one request after server errors (a 5xx, or an abort with a 5xx status); one
    more error raises ``RolloutError`` with the server's message."""
    error_backoff_s: float = 0.5
    """Wait before re-sending after a server error; doubles with each further error (up to 30 s)."""
    max_connections_per_server: int = 512
    """Most concurrent /generate connections to one server; more requests wait for one. Control
    calls use their own connections, so a pause is never stuck behind generations."""
    busy_backoff_s: float = 1.0
    """Wait after a 503 (full queue) when the server gives no Retry-After; doubles while it stays
    full, up to 8x."""
    batch_requests: bool = True
    """``generate_many`` asks for a group's answers in one /generate (SGLang's batch form), not
    one request per answer: one HTTP round trip per group on both sides."""
    initial_version: int = 0
    """The policy version every server holds when the client starts (the weights it was launched with)."""


@dataclass
class _Server:
    url: str
    version: int = 0
    """The policy version this server holds, by the client's record."""
    healthy: bool = True
    last_error: str = ""
    inflight: set[str] = field(default_factory=set)
    labels: dict[str, int] = field(default_factory=dict)
    """weight_version labels this server reported or was given -> the policy version they stand for."""
    keeps_labels: bool = False
    """The server confirmed that it took a label we gave (ours and SGLang >= 0.5 do): a weight
    update's reply said so, or it later reported such a label. Only then can an older label mean
    a restart; a server that ignores labels always reports its first one."""
    first_label: str | None = None
    """The label it reported at first contact (its launch weights), not one this client gave."""
    paused: bool = False
    """The server is paused, by what it last answered or reported. While the fleet runs, a paused
    server takes no requests: they would wait there until someone continues it."""
    pause_mode: str | None = None
    """The mode of this client's pause in effect on it (None while it runs)."""
    updates: int = 0
    """Weight changes this client began on it (a push, a load, a relabel): a reply to a request
    sent before the last one began may hold tokens of the weights before it."""
    updating: int = 0
    """Weight changes in progress on it: a request sent now may run under either weights."""
    kept_update: int = -1
    """``updates`` at the last change made while a pause kept its requests (``in_place``,
    ``retract``): a request that ran before it may hold tokens of both weights."""


class ServerPool:
    """Servers by URL, their health and versions; see the module docstring."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        if not addresses:
            raise ValueError("a rollout client needs at least one server address (host:port or URL)")
        self.cfg = config or ClientConfig()
        v0 = self.cfg.initial_version
        self.servers = [_Server(a if "://" in a else f"http://{a}", version=v0) for a in addresses]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._gen_session: aiohttp.ClientSession | None = None
        self._rr = itertools.cycle(range(len(self.servers)))
        self._sticky: dict[str, _Server] = {}
        self._health_task: asyncio.Task | None = None
        self._current = v0
        self._last_disk: tuple[str, int] | None = None
        self._continued = asyncio.Event()
        """Set while the fleet is not paused by this client (``_paused`` reads it): generation
        waits on it before sending."""
        self._continued.set()
        self._rechecks: dict[str, asyncio.Task] = {}
        """Version checks a reply asked for (``_recheck``), by server URL."""

    @property
    def _paused(self) -> bool:
        """This client paused the fleet and has not continued it yet."""
        return not self._continued.is_set()

    # -- versions --

    @contextlib.contextmanager
    def _changing(self, servers: Sequence[_Server]) -> Iterator[None]:
        """A weight change (push, load, relabel) runs on ``servers``: counted for the stamps of
        the replies it may cross (``HttpRolloutClient._stamp``)."""
        for s in servers:
            s.updates += 1
            s.updating += 1
            if s.pause_mode in KEEPING_PAUSE_MODES:
                s.kept_update = s.updates
        try:
            yield
        finally:
            for s in servers:
                s.updating -= 1

    @property
    def current_version(self) -> int:
        """The newest policy version pushed to the servers (``initial_version`` before any)."""
        return self._current

    def server_versions(self) -> dict[str, int]:
        """Each server's policy version by the client's record (it pushed them), by URL."""
        return {s.url: s.version for s in self.servers}

    def in_rotation(self) -> list[str]:
        """URLs of the servers new requests may go to: healthy, holding the current version, and
        not left paused while the fleet runs."""
        return [s.url for s in self.servers if self._usable(s) and s.version >= self._current]

    def _usable(self, s: _Server) -> bool:
        return s.healthy and not (s.paused and not self._paused)

    def _record(self, s: _Server, version: int, reply: Any = None) -> None:
        """``s`` now holds ``version`` (a push to it succeeded with ``reply``)."""
        s.version = version
        s.labels[str(version)] = version
        s.keeps_labels = s.keeps_labels or _confirms_label(reply, str(version))

    def _pushed(self, version: int, ok: list[tuple[_Server, Any]]) -> None:
        for s, reply in ok:
            self._record(s, version, reply)
        if ok:
            self._current = max(self._current, version)

    async def check_versions(self) -> None:
        """Ask every healthy server for its label; one reporting a label that stands for an older
        version than the client's record went back (a restart): its record drops to that version,
        which keeps it out of rotation until it holds the current one (reloaded from the last disk
        checkpoint at once, if there is one)."""
        await asyncio.gather(*(self._check_version(s) for s in self.servers if s.healthy))

    async def _check_version(self, s: _Server) -> bool:
        """See ``check_versions``; False if the server could not be reached."""
        try:
            status, body = await self._request(s, "GET", "/get_model_info", timeout=self.cfg.control_timeout_s)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self._mark_down(s, e)
            return False
        if status != 200 or not isinstance(body, dict):
            return True
        label = body.get("weight_version")
        label = "" if label is None else str(label)
        if not s.labels:  # first contact: this label is the initial version
            s.labels[label] = self.cfg.initial_version
            s.first_label = label
        elif label in s.labels and label != s.first_label:
            # It reports a label we pushed. Stock SGLang's update reply does not echo the label, so
            # this may be the first sign that it keeps labels (and so that a restart shows).
            s.keeps_labels = True
        held = s.labels.get(label)
        if held is None or held >= s.version or not s.keeps_labels:
            return True
        log.warning("server %s reports weight_version %r (version %d) but was given version %d: restarted? "
                    "Out of rotation until it holds version %d", s.url, label, held, s.version, self._current)
        s.version = held
        await self._reload(s)
        return True

    def _recheck(self, s: _Server) -> None:
        """Check ``s``'s version in the background (one check per server at a time): a reply
        said that it serves weights older than the client's record."""
        if s.url not in self._rechecks:
            task = asyncio.create_task(self._check_version(s), name=f"version-check {s.url}")
            self._rechecks[s.url] = task
            task.add_done_callback(lambda t: self._rechecks.pop(s.url, None) and (t.cancelled() or t.exception()))

    async def _reload(self, s: _Server) -> None:
        """Load the last disk checkpoint into ``s`` if it is the current version."""
        if self._last_disk is None or self._last_disk[1] < self._current:
            return
        path, version = self._last_disk
        with self._changing([s]):
            _, st, reply = await self._call_one(s, "/update_weights_from_disk", self._disk_body(path, version),
                                                self.cfg.weight_timeout_s)
        if st == 200 and not (isinstance(reply, dict) and reply.get("success") is False):
            self._record(s, version, reply)
            log.info("server %s reloaded version %d from %s", s.url, version, path)

    async def _readmit(self, s: _Server) -> bool:
        """Before a server that was down takes requests again: learn its weights (reloading the last
        disk checkpoint if it missed a push) and its pause state. A server left paused while the
        fleet runs is continued if it holds the current version, else it stays out of rotation
        until a push and a continue reach it; one running while the fleet is paused is paused.
        False if it could not be reached."""
        if not await self._check_version(s):
            return False
        if s.version < self._current:
            await self._reload(s)
        reached, paused = await self._reported_pause(s)
        if not reached:
            return False
        if self._paused and paused is False:
            _, st, _ = await self._call_one(s, "/pause_generation", {"mode": "abort"}, self.cfg.control_timeout_s)
            s.paused = st == 200
            s.pause_mode = "abort" if s.paused else None
        elif not self._paused and paused is not False:  # paused, or a server that does not say
            if s.version >= self._current:
                _, st, reply = await self._call_one(s, "/continue_generation", {}, self.cfg.control_timeout_s)
                s.paused = st != 200
                if s.paused:
                    log.warning("server %s stays out of rotation: /continue_generation answered %s: %s",
                                s.url, st, reply_message(reply))
            else:
                s.paused = bool(paused)
                if s.paused:
                    log.warning("server %s is paused and holds version %d, not %d: out of rotation until a "
                                "weight push and /continue_generation reach it", s.url, s.version, self._current)
        else:
            s.paused = bool(paused)
        return True

    async def _reported_pause(self, s: _Server) -> tuple[bool, bool | None]:
        """(reached, paused): whether ``s`` says it is paused (/get_server_info, ``paused`` at the
        top or in ``internal_states``); None when it does not say (stock SGLang)."""
        try:
            status, body = await self._request(s, "GET", "/get_server_info", timeout=self.cfg.control_timeout_s)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self._mark_down(s, e)
            return False, None
        if status != 200 or not isinstance(body, dict):
            return True, None
        states = [x for x in body.get("internal_states") or [] if isinstance(x, dict) and "paused" in x]
        if "paused" in body:
            states.append(body)
        return True, (any(bool(x["paused"]) for x in states) if states else None)

    # -- plumbing --

    @property
    def session(self) -> aiohttp.ClientSession:
        """Control calls (no connection cap)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s))
        return self._session

    @property
    def gen_session(self) -> aiohttp.ClientSession:
        """/generate calls, at most ``max_connections_per_server`` per server."""
        if self._gen_session is None or self._gen_session.closed:
            self._gen_session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=self.cfg.max_connections_per_server),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s))
        return self._gen_session

    async def start(self) -> None:
        """Check health and versions now and keep checking in the background."""
        await self.check_health()
        await self.check_versions()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        rechecks = list(self._rechecks.values())
        for task in rechecks:
            task.cancel()
        await asyncio.gather(*rechecks, return_exceptions=True)
        for session in (self._session, self._gen_session):
            if session is not None:
                await session.close()


    async def _request(self, server: _Server, method: str, path: str, *, json_body: Any = None,
                       data: Any = None, params: dict[str, str] | None = None,
                       timeout: float, headers: dict[str, str] | None = None,
                       session: aiohttp.ClientSession | None = None,
                       reply_headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One HTTP call; returns (status, parsed JSON or text). Connection errors propagate."""
        kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout), "params": params,
                              "headers": headers}
        if data is not None:
            kw["data"] = data
        elif json_body is not None:
            kw["data"] = P.encode(json_body)
            kw["headers"] = {**(headers or {}), "Content-Type": "application/json"}
        async with (session or self.session).request(method, server.url + path, **kw) as resp:
            raw = await resp.read()
            if reply_headers is not None:
                reply_headers.update(resp.headers)
        try:
            body: Any = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:  # not JSON: an error page, plain text
            body = raw.decode(errors="replace")
        return resp.status, body

    async def check_health(self) -> list[bool]:
        """GET /health on every server concurrently; updates and returns their health."""
        async def one(s: _Server) -> bool:
            try:
                status, body = await self._request(s, "GET", "/health", timeout=self.cfg.control_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                s.healthy, s.last_error = False, f"{type(e).__name__}: {e}"
                return False
            if status != 200:
                s.healthy, s.last_error = False, f"/health answered {status}: {body}"
            elif not s.healthy or s.paused != self._paused:
                # back, or left paused: learn its weights and pause state before it takes requests
                s.healthy = await self._readmit(s)
            return s.healthy

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.check_health()
            await self.check_versions()

    def _mark_down(self, server: _Server, err: BaseException | str) -> None:
        if server.healthy:
            log.warning("server %s is down: %s", server.url, err)
        server.healthy = False
        server.last_error = str(err) or type(err).__name__
        for rid in [r for r, s in self._sticky.items() if s is server]:
            self._sticky.pop(rid, None)

    async def _pick(self, rid: str) -> _Server:
        """The rid's sticky server while in rotation, else the next one round-robin that is healthy
        and holds the current version; if no healthy server holds it, any healthy one (its tokens
        carry its older version), so a fleet that lost its weights still answers."""
        s = self._sticky.get(rid)
        if s is not None and self._usable(s) and s.version >= self._current:
            return s
        deadline = time.monotonic() + self.cfg.all_down_wait_s
        while True:
            for fresh_only in (True, False):
                for _ in range(len(self.servers)):
                    s = self.servers[next(self._rr)]
                    if self._usable(s) and (s.version >= self._current or not fresh_only):
                        self._sticky[rid] = s
                        return s
            if time.monotonic() >= deadline:
                errors = "; ".join(f"{x.url}: {x.last_error}" for x in self.servers)
                raise AllServersDownError(f"no healthy rollout server for {self.cfg.all_down_wait_s:.0f}s ({errors})")
            await asyncio.sleep(min(1.0, self.cfg.all_down_wait_s / 10))
            await self.check_health()

    # -- fan-out control --

    async def _call_one(self, s: _Server, path: str, body: Any, timeout: float, **kw: Any) -> tuple[_Server, int, Any]:
        try:
            status, reply = await self._request(s, "POST", path, json_body=body, timeout=timeout, **kw)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self._mark_down(s, e)
            return s, 0, f"{type(e).__name__}: {e}"
        return s, status, reply

    async def _broadcast(self, path: str, body: Any, *, timeout: float, strict: bool = True,
                         version: int | None = None, **kw: Any) -> list[dict[str, Any]]:
        """POST to every healthy server concurrently. With ``strict``, any failure raises after
        all have answered; servers that cannot be reached are marked down and skipped. With a
        ``version``, the servers that succeed are recorded as holding it."""
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise AllServersDownError(f"{path}: no healthy server ("
                                      + "; ".join(f"{s.url}: {s.last_error}" for s in self.servers) + ")")
        if version is not None:
            for s in targets:  # a label seen while the call runs is not mistaken for a restart
                s.labels[str(version)] = version
        with self._changing(targets) if version is not None else contextlib.nullcontext():
            results = await asyncio.gather(*(self._call_one(s, path, body, timeout, **kw) for s in targets))
        failed = [(s, st, r) for s, st, r in results
                  if st != 200 or (isinstance(r, dict) and r.get("success") is False)]
        reached = [(s, st, r) for s, st, r in results if st != 0]
        if version is not None:
            self._pushed(version, [(s, r) for s, st, r in reached if (s, st, r) not in failed])
        if strict and any(st != 0 for _, st, _ in failed):
            msg = "; ".join(f"{s.url} ({st}): {reply_message(r)}" for s, st, r in failed if st != 0)
            raise WeightUpdateError(f"{path} failed on {msg}") if "weight" in path else RolloutError(f"{path}: {msg}")
        if not reached:
            raise AllServersDownError(f"{path}: every server failed to answer")
        return [{"server": s.url, "status": st, "reply": r} for s, st, r in reached]

    async def pause(self, mode: str = "abort") -> None:
        """Pause every server (``mode`` as SGLang's ``/pause_generation``). Until
        ``continue_generation``, this client sends no request: a server that reports no
        per-token versions (stock SGLang) would run one it got while paused under the weights
        pushed meanwhile, and its tokens would carry the version recorded when it was sent."""
        self._continued.clear()
        for s in self.servers:  # before the call: a server that paused but failed to say so counts
            s.pause_mode = mode
        for r in await self._broadcast("/pause_generation", {"mode": mode}, timeout=self.cfg.control_timeout_s):
            self._server(r["server"]).paused = True

    async def continue_generation(self) -> None:
        self._continued.set()
        replies = await self._broadcast("/continue_generation", {}, timeout=self.cfg.control_timeout_s, strict=False)
        for r in replies:  # a server whose continue failed stays paused: out of rotation
            ok = r["status"] == 200 and not (isinstance(r["reply"], dict) and r["reply"].get("success") is False)
            s = self._server(r["server"])
            s.paused = not ok
            if ok:
                s.pause_mode = None
        failed = [r for r in replies if self._server(r["server"]).paused]
        if failed:
            raise RolloutError("/continue_generation: " + "; ".join(
                f"{r['server']} ({r['status']}): {reply_message(r['reply'])}" for r in failed))

    def _server(self, url: str) -> _Server:
        return next(s for s in self.servers if s.url == url)

    async def flush_cache(self) -> None:
        await self._broadcast("/flush_cache", {}, timeout=self.cfg.control_timeout_s)

    @staticmethod
    def _disk_body(model_path: str, version: int, abort_all_requests: bool = False,
                   flush_cache: bool = True) -> dict[str, Any]:
        return {"model_path": model_path, "abort_all_requests": abort_all_requests,
                "weight_version": str(version), "flush_cache": flush_cache}

    async def update_weights_from_disk(self, model_path: str, *, version: int, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> list[dict[str, Any]]:
        """Every healthy server loads ``model_path`` as ``version`` (labelled ``str(version)``);
        those that succeed are recorded as holding it. The path is kept to reload a server that
        restarts."""
        try:
            return await self._broadcast("/update_weights_from_disk",
                                         self._disk_body(model_path, version, abort_all_requests, flush_cache),
                                         timeout=self.cfg.weight_timeout_s, version=version)
        finally:  # also when some servers failed: those that loaded it reload a restarted one
            if version >= self._current and any(s.version == version for s in self.servers):
                self._last_disk = (model_path, version)

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> list[dict[str, Any]]:
        """Relabel what every server serves as ``version`` (no new weights) and record it."""
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._broadcast("/update_weight_version", body, timeout=self.cfg.control_timeout_s,
                                     version=version)

    async def push_tensor_bucket(self, payload: bytes | Sequence[bytes | memoryview], *, version: int,
                                 transfer_id: str, bucket: int, last: bool, flush_cache: bool = True,
                                 skip: Any = (), layout: str = "hf", hold: bool = False,
                                 partial: bool = False) -> list[dict[str, Any]]:
        """One safetensors bucket of a version (its bytes, or the pieces of them in order, as
        ``safetensors_codec.tensor_bucket_parts`` makes them) to every embedded server but those in
        ``skip`` (URLs that failed an earlier bucket of this transfer, see ``HttpBucketSink``);
        after the ``last`` one, the servers that applied it are recorded as holding ``version``.
        ``layout``: ``hf``, or ``native`` for kernels in our own layout (``protocol``). ``hold``
        (with ``last``): the servers build the version but serve it only at ``commit_weights``.
        ``partial`` (with ``last``): the transfer leaves some of the model's tensors out on
        purpose; without it, a server refuses a version that lacks any."""
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
        size = sum(memoryview(p).nbytes for p in parts)
        params = {"weight_version": str(version), "transfer_id": transfer_id, "bucket": str(bucket),
                  "last": "true" if last else "false", "flush_cache": "true" if flush_cache else "false"}
        if layout != "hf":
            params["layout"] = layout
        if hold:
            params["hold"] = "true"
        if partial:
            params["partial"] = "true"
        targets = [s for s in self.servers if s.healthy and s.url not in skip]
        if not targets:
            raise AllServersDownError("/update_weights_from_tensor: no healthy server")
        if last:
            for s in targets:
                s.labels[str(version)] = version

        async def one(s: _Server) -> tuple[_Server, int, Any]:
            try:
                # Streamed in slices of the pieces with the length given: aiohttp writes one large
                # body several times slower (it buffers what the socket does not take at once).
                status, reply = await self._request(
                    s, "POST", "/update_weights_from_tensor", data=_slices(parts), params=params,
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                    timeout=self.cfg.weight_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self._mark_down(s, e)
                return s, 0, str(e)
            return s, status, reply

        with self._changing(targets) if last and not hold else contextlib.nullcontext():
            results = await asyncio.gather(*(one(s) for s in targets))
        if last and not hold:
            self._pushed(version, [(s, r) for s, st, r in results if st == 200])
        return self._weight_replies("/update_weights_from_tensor", results)

    async def commit_weights(self, version: int, transfer_id: str, *, skip: Any = (), flush_cache: bool = True,
                             pause_mode: str | None = None) -> list[dict[str, Any]]:
        """Every embedded server but those in ``skip`` serves ``version``, which it holds from
        a transfer pushed with ``hold``; those that do are recorded as holding it. With a
        ``pause_mode``, each server pauses that way for the swap and continues right after."""
        body: dict[str, Any] = {"transfer_id": transfer_id, "weight_version": str(version),
                                "flush_cache": flush_cache}
        if pause_mode is not None:
            body["pause_mode"] = pause_mode
        targets = [s for s in self.servers if s.healthy and s.url not in skip]
        if not targets:
            raise AllServersDownError("/commit_weights: no healthy server")
        with self._changing(targets):
            results = await asyncio.gather(*(self._call_one(s, "/commit_weights", body, self.cfg.weight_timeout_s)
                                             for s in targets))
        self._pushed(version, [(s, r) for s, st, r in results if st == 200])
        return self._weight_replies("/commit_weights", results)

    @staticmethod
    def _weight_replies(path: str, results: list[tuple[_Server, int, Any]]) -> list[dict[str, Any]]:
        """The replies of a weight call fanned out to servers; ``WeightUpdateError`` naming each
        server that answered but refused (one that could not be reached is already marked down)."""
        bad = [(s, st, r) for s, st, r in results if st not in (0, 200)]
        if bad:
            raise WeightUpdateError(f"{path} failed on "
                                    + "; ".join(f"{s.url} ({st}): {reply_message(r)}" for s, st, r in bad),
                                    {s.url: f"({st}) {reply_message(r)}" for s, st, r in bad})
        return [{"server": s.url, "status": st, "reply": r} for s, st, r in results if st == 200]

    async def get_model_info(self) -> list[dict[str, Any]]:
        async def one(s: _Server) -> dict[str, Any]:
            status, body = await self._request(s, "GET", "/get_model_info", timeout=self.cfg.control_timeout_s)
            return {"server": s.url, "status": status, "reply": body}

        return list(await asyncio.gather(*(one(s) for s in self.servers if s.healthy)))

    async def versions(self) -> dict[str, int]:
        """Each server's policy version by the client's record (``server_versions``)."""
        return self.server_versions()

    async def reported_versions(self) -> dict[str, str | None]:
        """The ``weight_version`` label each healthy server reports (opaque; SGLang: "default")."""
        return {r["server"]: (r["reply"] or {}).get("weight_version") if isinstance(r["reply"], dict) else None
                for r in await self.get_model_info() if r["status"] == 200}


def reply_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def _confirms_label(reply: Any, label: str) -> bool:
    """Whether a weight-update reply says the server now reports ``label`` (our server: its
    ``weight_version``; SGLang: ``new_version`` or "Weight version updated to ..." in the message)."""
    if not isinstance(reply, dict):
        return False
    return (reply.get("weight_version") == label or reply.get("new_version") == label
            or f"Weight version updated to {label}" in str(reply.get("message", "")))


async def _slices(parts: Sequence[bytes | memoryview], size: int = 1 << 20) -> AsyncIterator[memoryview]:
    """``parts`` in slices of at most ``size`` bytes, views all (a request body streamed)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, size):
            yield view[start:start + size]
