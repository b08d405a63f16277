"""The fleet's state as a rollout client records it: each server's health, the policy version
it holds and whether it is paused, and the weight changes in progress on it.

Versions: the client keeps its own record of which policy version each server holds, because it
pushed them (``update_weights_from_disk``, ``push_tensor_bucket``, ``update_weight_version``). A
server's ``weight_version`` is an opaque label (stock SGLang says "default"): it is only compared
with the labels this client gave that server, to notice a server that went back to older weights
(a restart). Such a server is kept out of rotation until it holds the current version again:
re-loaded at once from the last disk checkpoint when there is one, else at the next push. A
server that comes back is re-admitted only once its weights and pause state are known."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp

from rollout_bridge.records import KEEPING_PAUSE_MODES, ClientConfig, ServerRecord, confirms_label, reply_message
from rollout_bridge.transport import Transport

log = logging.getLogger("rollout_bridge.client")


class FleetState(Transport):
    """Health, versions and pause state of the servers (see the module docstring)."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, config: ClientConfig | None = None):
        super().__init__(addresses, api_key=api_key, config=config)
        self._health_task: asyncio.Task | None = None
        self._current = self.cfg.initial_version
        self._last_disk: tuple[str, int] | None = None
        self.continued = asyncio.Event()
        """Set while the fleet is not paused by this client (``_paused`` reads it): generation
        waits on it before sending."""
        self.continued.set()
        self._rechecks: dict[str, asyncio.Task] = {}
        """Version checks a reply asked for (``recheck``), by server URL."""

    @property
    def _paused(self) -> bool:
        """This client paused the fleet and has not continued it yet."""
        return not self.continued.is_set()

    @contextlib.contextmanager
    def _changing(self, servers: Sequence[ServerRecord]) -> Iterator[None]:
        """A weight change (push, load, relabel) runs on ``servers``: counted for the stamps of
        the replies it may cross (``HttpRolloutClient._stamp``)."""
        for s in servers:
            s.updates += 1
            s.updating += 1
            if s.pause_mode in KEEPING_PAUSE_MODES:
                s.kept_update = s.updates
            if s.pause_mode is None:
                s.free_update = s.updates
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

    def _usable(self, s: ServerRecord) -> bool:
        return s.healthy and not (s.paused and not self._paused)

    def _record(self, s: ServerRecord, version: int, reply: Any = None) -> None:
        """``s`` now holds ``version`` (a push to it succeeded with ``reply``)."""
        s.version = version
        s.labels[str(version)] = version
        s.keeps_labels = s.keeps_labels or confirms_label(reply, str(version))

    def _pushed(self, version: int, ok: list[tuple[ServerRecord, Any]]) -> None:
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

    async def _check_version(self, s: ServerRecord) -> bool:
        """See ``check_versions``; False if the server could not be reached."""
        try:
            status, body = await self.request(s, "GET", "/get_model_info", timeout=self.cfg.control_timeout_s)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.mark_down(s, e)
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

    def recheck(self, s: ServerRecord) -> None:
        """Check ``s``'s version in the background (one check per server at a time): a reply
        said that it serves weights older than the client's record."""
        if s.url not in self._rechecks:
            task = asyncio.create_task(self._check_version(s), name=f"version-check {s.url}")
            self._rechecks[s.url] = task
            task.add_done_callback(lambda t: self._rechecks.pop(s.url, None) and (t.cancelled() or t.exception()))

    async def _reload(self, s: ServerRecord) -> None:
        """Load the last disk checkpoint into ``s`` if it is the current version."""
        if self._last_disk is None or self._last_disk[1] < self._current:
            return
        path, version = self._last_disk
        with self._changing([s]):
            _, st, reply = await self.call_one(s, "/update_weights_from_disk", self._disk_body(path, version),
                                                self.cfg.weight_timeout_s)
        if st == 200 and not (isinstance(reply, dict) and reply.get("success") is False):
            self._record(s, version, reply)
            log.info("server %s reloaded version %d from %s", s.url, version, path)

    async def _readmit(self, s: ServerRecord) -> bool:
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
            _, st, _ = await self.call_one(s, "/pause_generation", {"mode": "abort"}, self.cfg.control_timeout_s)
            s.paused = st == 200
            s.pause_mode = "abort" if s.paused else None
        elif not self._paused and paused is not False:  # paused, or a server that does not say
            if s.version >= self._current:
                s.continues += 1
                _, st, reply = await self.call_one(s, "/continue_generation", {}, self.cfg.control_timeout_s)
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

    async def _reported_pause(self, s: ServerRecord) -> tuple[bool, bool | None]:
        """(reached, paused): whether ``s`` says it is paused (/get_server_info, ``paused`` at the
        top or in ``internal_states``); None when it does not say (stock SGLang)."""
        try:
            status, body = await self.request(s, "GET", "/get_server_info", timeout=self.cfg.control_timeout_s)
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            self.mark_down(s, e)
            return False, None
        if status != 200 or not isinstance(body, dict):
            return True, None
        states = [x for x in body.get("internal_states") or [] if isinstance(x, dict) and "paused" in x]
        if "paused" in body:
            states.append(body)
        return True, (any(bool(x["paused"]) for x in states) if states else None)

    async def check_health(self) -> list[bool]:
        """GET /health on every server concurrently; updates and returns their health."""
        async def one(s: ServerRecord) -> bool:
            try:
                status, body = await self.request(s, "GET", "/health", timeout=self.cfg.control_timeout_s)
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

    @staticmethod
    def _disk_body(model_path: str, version: int, abort_all_requests: bool = False,
                   flush_cache: bool = True) -> dict[str, Any]:
        return {"model_path": model_path, "abort_all_requests": abort_all_requests,
                "weight_version": str(version), "flush_cache": flush_cache}
