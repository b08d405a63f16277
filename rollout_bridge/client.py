"""The rollout client: asks inference servers (real SGLang or our embedded JAX server) for answers.

``RolloutClient`` is the interface the controller sees; ``HttpRolloutClient`` drives any number
of servers over HTTP. A generation that comes back aborted (a weight update paused the server)
or whose server died is re-sent, to the same server or another, as prompt + tokens so far with
the remaining token budget, until it stops or reaches its length; every token keeps the version
that produced it. Control calls (pause, weight updates, continue, flush) fan out to all servers
concurrently. Every call has a timeout.
"""

from __future__ import annotations

import abc
import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from rollout_bridge import protocol as P

log = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """A generation or control call that cannot succeed; the message says which server and why."""


class AllServersDownError(RolloutError):
    pass


class WeightUpdateError(RolloutError):
    pass


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
    resends: int = 0
    """How many times the request was re-sent (after an abort or a dead server)."""


class RolloutClient(abc.ABC):
    """What the controller needs from rollout; HTTP here, a colocated in-process engine later."""

    @abc.abstractmethod
    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None) -> GenerateResult: ...

    @abc.abstractmethod
    async def pause(self, mode: str = "abort") -> None: ...

    @abc.abstractmethod
    async def continue_generation(self) -> None: ...

    @abc.abstractmethod
    async def update_weights_from_disk(self, model_path: str, *, version: int,
                                       abort_all_requests: bool = False) -> list[dict[str, Any]]: ...

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...


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
    """Bound on re-sends of one request (aborts plus failovers)."""


@dataclass
class _Server:
    url: str
    healthy: bool = True
    last_error: str = ""
    inflight: set[str] = field(default_factory=set)


class HttpRolloutClient(RolloutClient):
    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        if not addresses:
            raise ValueError("HttpRolloutClient needs at least one server address (host:port or URL)")
        self.cfg = config or ClientConfig()
        self.servers = [_Server(a if "://" in a else f"http://{a}") for a in addresses]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._rr = itertools.cycle(range(len(self.servers)))
        self._sticky: dict[str, _Server] = {}
        self._cancelled: set[str] = set()
        self._health_task: asyncio.Task | None = None

    # -- plumbing --

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.cfg.connect_timeout_s))
        return self._session

    async def start(self) -> None:
        """Check health now and keep checking in the background."""
        await self.check_health()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> HttpRolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _request(self, server: _Server, method: str, path: str, *, json_body: Any = None,
                       data: bytes | None = None, params: dict[str, str] | None = None,
                       timeout: float, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """One HTTP call; returns (status, parsed JSON or text). Connection errors propagate."""
        kw: dict[str, Any] = {"timeout": aiohttp.ClientTimeout(total=timeout), "params": params,
                              "headers": headers}
        if data is not None:
            kw["data"] = data
        elif json_body is not None:
            kw["data"] = P.encode(json_body)
            kw["headers"] = {**(headers or {}), "Content-Type": "application/json"}
        async with self.session.request(method, server.url + path, **kw) as resp:
            raw = await resp.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        return resp.status, body

    async def check_health(self) -> list[bool]:
        """GET /health on every server concurrently; updates and returns their health."""
        async def one(s: _Server) -> bool:
            try:
                status, body = await self._request(s, "GET", "/health", timeout=self.cfg.control_timeout_s)
                s.healthy = status == 200
                if not s.healthy:
                    s.last_error = f"/health answered {status}: {body}"
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                s.healthy, s.last_error = False, f"{type(e).__name__}: {e}"
            return s.healthy

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await self.check_health()

    def _mark_down(self, server: _Server, err: BaseException | str) -> None:
        if server.healthy:
            log.warning("server %s is down: %s", server.url, err)
        server.healthy = False
        server.last_error = str(err) or type(err).__name__
        for rid in [r for r, s in self._sticky.items() if s is server]:
            self._sticky.pop(rid, None)

    async def _pick(self, rid: str) -> _Server:
        """The rid's sticky server while healthy, else the next healthy one round-robin."""
        s = self._sticky.get(rid)
        if s is not None and s.healthy:
            return s
        deadline = time.monotonic() + self.cfg.all_down_wait_s
        while True:
            for _ in range(len(self.servers)):
                s = self.servers[next(self._rr)]
                if s.healthy:
                    self._sticky[rid] = s
                    return s
            if time.monotonic() >= deadline:
                errors = "; ".join(f"{x.url}: {x.last_error}" for x in self.servers)
                raise AllServersDownError(f"no healthy rollout server for {self.cfg.all_down_wait_s:.0f}s ({errors})")
            await asyncio.sleep(min(1.0, self.cfg.all_down_wait_s / 10))
            await self.check_health()

    # -- generation --

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None) -> GenerateResult:
        """Generate until stop or length, re-sending after aborts and dead servers.

        ``sampling_params`` uses SGLang's names (``max_new_tokens``, ``temperature``, ...).
        A 400 from a server is the caller's error and raises ``RolloutError`` without retrying.
        """
        sp = dict(sampling_params or {})
        budget = int(sp.get("max_new_tokens", P.SamplingParams().max_new_tokens))
        rid = rid or uuid.uuid4().hex
        prompt = list(input_ids)
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        text = ""
        finish: dict[str, Any] = {"type": "length", "length": budget}
        attempt = idle = 0
        try:
            while len(out) < budget or budget == 0:
                if attempt > self.cfg.max_resends:
                    raise RolloutError(f"request {rid}: gave up after {self.cfg.max_resends} re-sends")
                server = await self._pick(rid)
                sub_rid = rid if attempt == 0 else f"{rid}-r{attempt}"
                payload = {"input_ids": prompt + out, "rid": sub_rid, "return_logprob": True, "stream": False,
                           "sampling_params": {**sp, "max_new_tokens": budget - len(out)}}
                attempt += 1
                server.inflight.add(sub_rid)
                try:
                    status, body = await self._request(server, "POST", "/generate", json_body=payload,
                                                       timeout=self.cfg.generate_timeout_s)
                except (TimeoutError, aiohttp.ClientError, OSError) as e:
                    self._mark_down(server, e)
                    continue
                finally:
                    server.inflight.discard(sub_rid)
                if status == 400 or status == 401:
                    raise RolloutError(f"{server.url}/generate rejected request {rid} ({status}): {_message(body)}")
                if status != 200 or not isinstance(body, dict):
                    self._mark_down(server, f"/generate answered {status}: {_message(body)}")
                    continue
                ids, lps, vers, finish = _parse_reply(body)
                out += ids
                logprobs += lps
                versions += vers
                text = body.get("text", "")
                if finish.get("type") == "abort":
                    code = finish.get("status_code")
                    if rid in self._cancelled:
                        break
                    if code is not None and 400 <= int(code) < 500:
                        raise RolloutError(f"{server.url} aborted request {rid}: {finish.get('message')}")
                    # Aborted by a pause or weight update: resume with what we have. A server that
                    # keeps aborting without progress is backed off, not hammered.
                    idle = 0 if ids else idle + 1
                    if idle:
                        await asyncio.sleep(min(0.05 * 2 ** min(idle, 5), 1.0))
                    continue
                if budget == 0:
                    break
                if finish.get("type") in ("stop", "length"):
                    break
            if len(out) >= budget and finish.get("type") == "abort":
                finish = {"type": "length", "length": budget}
        finally:
            self._sticky.pop(rid, None)
            self._cancelled.discard(rid)
        if finish.get("type") == "length":
            finish = {"type": "length", "length": len(out)}
        return GenerateResult(rid=rid, input_ids=prompt, output_ids=out, output_logprobs=logprobs,
                              output_versions=versions, finish_reason=finish, text=text, resends=attempt - 1)

    async def abort(self, rid: str) -> None:
        """Stop one request for good: it returns what it has with an abort finish reason."""
        self._cancelled.add(rid)
        for s in self.servers:
            for sub in [r for r in s.inflight if r == rid or r.startswith(f"{rid}-r")]:
                await self._call_one(s, "/abort_request", {"rid": sub}, self.cfg.control_timeout_s)

    # -- fan-out control --

    async def _call_one(self, s: _Server, path: str, body: Any, timeout: float, **kw: Any) -> tuple[_Server, int, Any]:
        try:
            status, reply = await self._request(s, "POST", path, json_body=body, timeout=timeout, **kw)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self._mark_down(s, e)
            return s, 0, f"{type(e).__name__}: {e}"
        return s, status, reply

    async def _broadcast(self, path: str, body: Any, *, timeout: float, strict: bool = True,
                         **kw: Any) -> list[dict[str, Any]]:
        """POST to every healthy server concurrently. With ``strict``, any failure raises after
        all have answered; servers that cannot be reached are marked down and skipped."""
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise AllServersDownError(f"{path}: no healthy server ("
                                      + "; ".join(f"{s.url}: {s.last_error}" for s in self.servers) + ")")
        results = await asyncio.gather(*(self._call_one(s, path, body, timeout, **kw) for s in targets))
        failed = [(s, st, r) for s, st, r in results
                  if st != 200 or (isinstance(r, dict) and r.get("success") is False)]
        reached = [(s, st, r) for s, st, r in results if st != 0]
        if strict and any(st != 0 for _, st, _ in failed):
            msg = "; ".join(f"{s.url} ({st}): {_message(r)}" for s, st, r in failed if st != 0)
            raise WeightUpdateError(f"{path} failed on {msg}") if "weight" in path else RolloutError(f"{path}: {msg}")
        if not reached:
            raise AllServersDownError(f"{path}: every server failed to answer")
        return [{"server": s.url, "status": st, "reply": r} for s, st, r in reached]

    async def pause(self, mode: str = "abort") -> None:
        await self._broadcast("/pause_generation", {"mode": mode}, timeout=self.cfg.control_timeout_s)

    async def continue_generation(self) -> None:
        await self._broadcast("/continue_generation", {}, timeout=self.cfg.control_timeout_s)

    async def flush_cache(self) -> None:
        await self._broadcast("/flush_cache", {}, timeout=self.cfg.control_timeout_s)

    async def update_weights_from_disk(self, model_path: str, *, version: int, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> list[dict[str, Any]]:
        body = {"model_path": model_path, "abort_all_requests": abort_all_requests,
                "weight_version": str(version), "flush_cache": flush_cache}
        return await self._broadcast("/update_weights_from_disk", body, timeout=self.cfg.weight_timeout_s)

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> list[dict[str, Any]]:
        body = {"new_version": str(version), "abort_all_requests": abort_all_requests}
        return await self._broadcast("/update_weight_version", body, timeout=self.cfg.control_timeout_s)

    async def push_tensor_bucket(self, payload: bytes, *, version: int, transfer_id: str, bucket: int, last: bool,
                                 flush_cache: bool = True) -> list[dict[str, Any]]:
        """One safetensors bucket of a version to every embedded server (see ``protocol``)."""
        params = {"weight_version": str(version), "transfer_id": transfer_id, "bucket": str(bucket),
                  "last": "true" if last else "false", "flush_cache": "true" if flush_cache else "false"}
        targets = [s for s in self.servers if s.healthy]
        if not targets:
            raise AllServersDownError("/update_weights_from_tensor: no healthy server")

        async def one(s: _Server) -> tuple[_Server, int, Any]:
            try:
                status, reply = await self._request(
                    s, "POST", "/update_weights_from_tensor", data=payload, params=params,
                    headers={"Content-Type": "application/octet-stream"}, timeout=self.cfg.weight_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self._mark_down(s, e)
                return s, 0, str(e)
            return s, status, reply

        results = await asyncio.gather(*(one(s) for s in targets))
        bad = [(s, st, r) for s, st, r in results if st not in (0, 200)]
        if bad:
            raise WeightUpdateError("/update_weights_from_tensor failed on "
                                    + "; ".join(f"{s.url} ({st}): {_message(r)}" for s, st, r in bad))
        return [{"server": s.url, "status": st, "reply": r} for s, st, r in results if st == 200]

    async def get_model_info(self) -> list[dict[str, Any]]:
        async def one(s: _Server) -> dict[str, Any]:
            status, body = await self._request(s, "GET", "/get_model_info", timeout=self.cfg.control_timeout_s)
            return {"server": s.url, "status": status, "reply": body}

        return list(await asyncio.gather(*(one(s) for s in self.servers if s.healthy)))

    async def versions(self) -> dict[str, int]:
        """Each healthy server's weight version (SGLang's string parsed as our integer)."""
        return {r["server"]: P.parse_version(r["reply"].get("weight_version"))
                for r in await self.get_model_info() if r["status"] == 200}


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def _parse_reply(body: dict[str, Any]) -> tuple[list[int], list[float], list[int], dict[str, Any]]:
    """Tokens, logprobs, per-token versions and finish reason of one /generate reply."""
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
    return ids, lps, P.token_versions(meta, len(ids)), finish
