"""Where a request goes: its rid's server while that one stays in rotation, else its session's
(the server an agent run's last turn went to, whose prefix cache holds the turns before), else
the next healthy server holding the current version, round-robin (any healthy one if none holds it)."""

from __future__ import annotations

import asyncio
import itertools
import time

from rollout_bridge.fleet import FleetState
from rollout_bridge.records import AllServersDownError, ClientConfig, ServerRecord

MAX_SESSIONS = 10_000
"""Sessions remembered (least recently used forgotten first): a forgotten one goes round-robin."""


class Routing(FleetState):
    """``pick``: the server for a request (see the module docstring)."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        super().__init__(addresses, api_key=api_key, config=config)
        self._rr = itertools.cycle(range(len(self.servers)))

    async def pick(self, rid: str, session: str | None = None) -> ServerRecord:
        """The rid's sticky server while in rotation, else the session's, else the next one
        round-robin that is healthy and holds the current version; if no healthy server holds it,
        any healthy one (its tokens carry its older version), so a fleet that lost its weights
        still answers. The server picked becomes the session's."""
        s = self.sticky.get(rid)
        if self._fresh(s):
            return s
        if session is None:
            return await self._round_robin(rid)
        s = self.sessions.get(session)
        if self._fresh(s):
            self.sticky[rid] = s
        else:
            s = await self._round_robin(rid)
        self.sessions[session] = s
        self.sessions.move_to_end(session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)
        return s

    def _fresh(self, s: ServerRecord | None) -> bool:
        """A server in rotation that holds the current version."""
        return s is not None and self._usable(s) and s.version >= self._current

    async def _round_robin(self, rid: str) -> ServerRecord:
        deadline = time.monotonic() + self.cfg.all_down_wait_s
        while True:
            for fresh_only in (True, False):
                for _ in range(len(self.servers)):
                    s = self.servers[next(self._rr)]
                    if self._usable(s) and (s.version >= self._current or not fresh_only):
                        self.sticky[rid] = s
                        return s
            if time.monotonic() >= deadline:
                errors = "; ".join(f"{x.url}: {x.last_error}" for x in self.servers)
                raise AllServersDownError(f"no healthy rollout server for {self.cfg.all_down_wait_s:.0f}s ({errors})")
            await asyncio.sleep(min(1.0, self.cfg.all_down_wait_s / 10))
            await self.check_health()
