"""The set of inference servers a rollout client talks to, and the control calls that fan out to
all of them: pause and continue, weight loads and pushes, relabels, cache flushes. Built in
layers, one idea each: ``records`` (what is known of a server), ``transport`` (the calls),
``fleet`` (health, versions, pause state), ``routing`` (where a request goes), and here the
fan-out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from rollout_bridge.records import (
    KEEPING_PAUSE_MODES,
    AllServersDownError,
    ClientConfig,
    RolloutError,
    ServerRecord,
    WeightUpdateError,
    reply_message,
)
from rollout_bridge.routing import Routing
from rollout_bridge.transport import _slices

log = logging.getLogger("rollout_bridge.client")

__all__ = ["KEEPING_PAUSE_MODES", "AllServersDownError", "ClientConfig", "RolloutError", "ServerPool",
           "ServerRecord", "WeightUpdateError", "reply_message"]


class ServerPool(Routing):
    """Servers by URL, their health and versions, and the calls to all of them."""

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
        await self.close_sessions()

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
            results = await asyncio.gather(*(self.call_one(s, path, body, timeout, **kw) for s in targets))
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
        self.continued.clear()
        for s in self.servers:  # before the call: a server that paused but failed to say so counts
            s.pause_mode = mode
        for r in await self._broadcast("/pause_generation", {"mode": mode}, timeout=self.cfg.control_timeout_s):
            self._server(r["server"]).paused = True

    async def continue_generation(self) -> None:
        self.continued.set()
        for s in self.servers:  # before the call: a held request may run as soon as it lands
            s.continues += 1
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

    async def flush_cache(self) -> None:
        await self._broadcast("/flush_cache", {}, timeout=self.cfg.control_timeout_s)

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

        async def one(s: ServerRecord) -> tuple[ServerRecord, int, Any]:
            try:
                # Streamed in slices of the pieces with the length given: aiohttp writes one large
                # body several times slower (it buffers what the socket does not take at once).
                status, reply = await self.request(
                    s, "POST", "/update_weights_from_tensor", data=_slices(parts), params=params,
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                    timeout=self.cfg.weight_timeout_s)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self.mark_down(s, e)
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
            results = await asyncio.gather(*(self.call_one(s, "/commit_weights", body, self.cfg.weight_timeout_s)
                                             for s in targets))
        self._pushed(version, [(s, r) for s, st, r in results if st == 200])
        return self._weight_replies("/commit_weights", results)

    @staticmethod
    def _weight_replies(path: str, results: list[tuple[ServerRecord, int, Any]]) -> list[dict[str, Any]]:
        """The replies of a weight call fanned out to servers; ``WeightUpdateError`` naming each
        server that answered but refused (one that could not be reached is already marked down)."""
        bad = [(s, st, r) for s, st, r in results if st not in (0, 200)]
        if bad:
            raise WeightUpdateError(f"{path} failed on "
                                    + "; ".join(f"{s.url} ({st}): {reply_message(r)}" for s, st, r in bad),
                                    {s.url: f"({st}) {reply_message(r)}" for s, st, r in bad})
        return [{"server": s.url, "status": st, "reply": r} for s, st, r in results if st == 200]

    async def get_model_info(self) -> list[dict[str, Any]]:
        async def one(s: ServerRecord) -> dict[str, Any]:
            status, body = await self.request(s, "GET", "/get_model_info", timeout=self.cfg.control_timeout_s)
            return {"server": s.url, "status": status, "reply": body}

        return list(await asyncio.gather(*(one(s) for s in self.servers if s.healthy)))

    async def versions(self) -> dict[str, int]:
        """Each server's policy version by the client's record (``server_versions``)."""
        return self.server_versions()

    async def reported_versions(self) -> dict[str, str | None]:
        """The ``weight_version`` label each healthy server reports (opaque; SGLang: "default")."""
        return {r["server"]: (r["reply"] or {}).get("weight_version") if isinstance(r["reply"], dict) else None
                for r in await self.get_model_info() if r["status"] == 200}
