"""How a rollout client talks to its servers: two HTTP sessions (control calls uncapped,
/generate capped per server), one call with its timeout, and a server marked down when a call
cannot reach it."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import msgspec

from rollout_bridge import protocol as P
from rollout_bridge.records import ClientConfig, ServerRecord

log = logging.getLogger("rollout_bridge.client")


class Transport:
    """The servers by URL and the calls to them."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        if not addresses:
            raise ValueError("a rollout client needs at least one server address (host:port or URL)")
        self.cfg = config or ClientConfig()
        v0 = self.cfg.initial_version
        self.servers = [ServerRecord(a if "://" in a else f"http://{a}", version=v0) for a in addresses]
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._gen_session: aiohttp.ClientSession | None = None
        self.sticky: dict[str, ServerRecord] = {}
        """Rids (and groups) by the server they went to; a server marked down loses its own."""
        self.sessions: OrderedDict[str, ServerRecord] = OrderedDict()
        """Sessions (an agent run's turns) by the server their last request went to, least recently
        used first; a server marked down loses its own."""

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

    async def request(self, server: ServerRecord, method: str, path: str, *, json_body: Any = None,
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

    async def call_one(self, s: ServerRecord, path: str, body: Any, timeout: float,
                       **kw: Any) -> tuple[ServerRecord, int, Any]:
        try:
            status, reply = await self.request(s, "POST", path, json_body=body, timeout=timeout, **kw)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.mark_down(s, e)
            return s, 0, f"{type(e).__name__}: {e}"
        return s, status, reply

    def mark_down(self, server: ServerRecord, err: BaseException | str) -> None:
        if server.healthy:
            log.warning("server %s is down: %s", server.url, err)
        server.healthy = False
        server.last_error = str(err) or type(err).__name__
        for rid in [r for r, s in self.sticky.items() if s is server]:
            self.sticky.pop(rid, None)
        for session in [k for k, s in self.sessions.items() if s is server]:
            self.sessions.pop(session, None)

    def _server(self, url: str) -> ServerRecord:
        return next(s for s in self.servers if s.url == url)

    async def close_sessions(self) -> None:
        for session in (self._session, self._gen_session):
            if session is not None:
                await session.close()


async def _slices(parts: Sequence[bytes | memoryview], size: int = 1 << 20) -> AsyncIterator[memoryview]:
    """``parts`` in slices of at most ``size`` bytes, views all (a request body streamed)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, size):
            yield view[start:start + size]
