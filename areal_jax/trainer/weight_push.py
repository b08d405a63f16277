"""The weight-push protocol: how a new policy version goes from the trainer to rollout. It owns
the weight sink (built here from the run's config), the stream of HF tensors the sink takes
(``iter_hf_tensors``, called here and nowhere else in the loop), and the one push in flight.

A plain push, in async mode, sits between a pause (with abort) and a continue: answers in flight
resume under the new weights. A held push (``rollout.push_before_pause``, with a sink that can
hold a version) is sent while rollout still generates, then swapped in within one pause.

In async mode the push of a version overlaps the next batch's update
(``rollout.overlap_weight_push``): the controller holds the new version at once (see
``WeightPush.start`` for why the staleness bound still holds), and the push streams from params
the trainer lent, which that update leaves alone. A step that evaluates waits for its push
(``WeightPush.settle``), so held-out accuracy is always the version just trained.

In a run of several processes every weight gather is a collective that all of them enter in
the same order as the train steps around it, while only process 0 holds the rollout client. A
plain push streams: each tensor is gathered (every process) and sent (process 0) in turn. An
overlapped push cannot gather while the next update runs (the two would interleave differently
on each process), so it gathers every tensor first, in the run's order, onto process 0's host
(one copy of the model in the push dtype there), and only the sending, which is most of a
push's time, overlaps the next update. A held push is the same push sent before the pause, so
it works as either. The other processes' half is ``take_part``.

With ``backend: local`` on several processes every host has its own engine, served over HTTP
(``rollout_bridge/hosts.py``, which says why), and no weight crosses the network: every process
keeps what its gathers give and stages it into its own engine (``HostsSink``), the followers
post how that went, and process 0 commits the version on every engine that holds it, inside its
pause or with the commit's own, so that every engine swaps to the new version under its label
(its tokens stamped with it from the swap on, never before). The staging is the collective part
(an overlapped push does it before the next update); the commit is all that overlaps.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_jax.models.hf_io import HFTensorStream, iter_hf_tensors
from areal_jax.trainer.run_config import RunConfig
from rollout_bridge.records import WeightUpdateError
from rollout_bridge.streamer import HttpBucketSink, TransferMetrics

log = logging.getLogger(__name__)


def make_sink(cfg: RunConfig, client: Any, hf_config: dict[str, Any], run_dir: Path, tokenizer_dir: Path,
              hosts: tuple[Any, Any] | None = None) -> Any:
    """The weight sink of ``cfg.rollout``: device to device to an in-process engine, HTTP buckets
    to our servers, or safetensors on disk that the servers load (``hf_config`` and
    ``tokenizer_dir`` make that directory a model they can read). ``hosts``: ``(EngineHost,
    StepHub)`` of a multi-process ``backend: local`` run (``HostsSink``)."""
    from rollout_bridge.streamer import DiskSink, LocalSink

    rollout = cfg.rollout
    if hosts is not None:
        return HostsSink(client, *hosts)
    if rollout.backend == "local":
        return LocalSink(client)
    if rollout.weight_sync == "http":
        return HttpBucketSink(client)
    return DiskSink(rollout.weights_dir or run_dir / "weights", hf_config, client=client,
                    tokenizer_dir=tokenizer_dir, server_root=rollout.servers_weights_dir)


def take_part(trainer: Any, hf_layout: bool, *, host: Any = None, hub: Any = None, version: int = 0) -> None:
    """A follower's half of a push (process 1 and up): the gathers, collectives that process 0
    enters too. Without a ``host`` only process 0 keeps and sends the tensors; with this host's
    ``EngineHost`` (``backend: local`` on several processes) this process keeps them too, stages
    them into its engine as ``version`` and posts how that went to process 0 through ``hub``."""
    tensors = iter_hf_tensors(trainer.model(), owned=None if host is not None else lambda name: False,
                              hf_layout=hf_layout)
    if host is None:
        collections.deque(tensors, 0)
        return
    error = host.hold(tensors, transfer_id(version), str(version))
    hub.post(f"push/{transfer_id(version)}", error or "")


def transfer_id(version: int) -> str:
    """The transfer every host holds ``version`` under, until process 0 commits it."""
    return f"v{version}"


class HostsSink(HttpBucketSink):
    """The engines of a multi-process ``backend: local`` run, one per host, each served over HTTP
    by its own process (see the module docstring): ``stage`` this process's gathered copy into
    its own engine and learn how the followers' went, then ``deliver`` (commit, now or held)."""

    def __init__(self, client: Any, host: Any, hub: Any):
        super().__init__(client, native_layout=True)  # our own engines: kernels in our layout
        self.host, self.hub = host, hub

    async def stage(self, version: int, tensors: HFTensorStream) -> dict[str, str]:
        """This process's half of ``version`` (every follower does the same in ``take_part``);
        returns, by URL, why each engine that does not hold it failed."""
        t_id = transfer_id(version)
        error = await asyncio.to_thread(self.host.hold, tensors, t_id, str(version))
        posted = await asyncio.to_thread(self.hub.collect, f"push/{t_id}", self.client.cfg.weight_timeout_s)
        urls = [s.url for s in self.client.servers]  # in process order: this process's engine first
        return {urls[p]: why for p, why in enumerate([error or "", *posted]) if why}

    async def deliver(self, version: int, failed: dict[str, str], *, hold: bool = False) -> None:
        """Every engine that holds ``version`` (all but ``failed``) serves it now, or with
        ``hold`` at ``commit(version)``; ``WeightUpdateError`` names those that failed."""
        why = "; ".join(f"{url} {reason}" for url, reason in failed.items())
        if len(failed) >= len(self.client.servers):
            self._held = None
            raise WeightUpdateError(f"no host could stage version {version}: {why}", failed)
        self._held = (version, transfer_id(version), failed)
        if not hold:
            await self.commit(version)
        if failed:
            raise WeightUpdateError(f"version {version} could not be staged on {why}", failed)

    async def push(self, version: int, tensors: Any, *, hold: bool = False) -> TransferMetrics:
        t0 = time.perf_counter()
        await self.deliver(version, await self.stage(version, tensors), hold=hold)
        return TransferMetrics(version=version, bytes=0, seconds=time.perf_counter() - t0, buckets=0,
                               tensors=len(tensors.layout), servers=len(self.client.servers))


class WeightPush:
    """Process 0's pushes of the trainer's weights to rollout (``client``) through ``sink``, one at
    a time and in version order. ``controller`` (set once it exists; the restored policy's push
    at resume comes before it) is paused, drained and resumed around a push and told the version
    it may hand out; ``hub`` announces the gathers to the other processes of the run."""

    def __init__(self, cfg: RunConfig, trainer: Any, client: Any, sink: Any, controller: Any = None,
                 hub: Any = None) -> None:
        self.cfg, self.rollout = cfg, cfg.rollout
        self.trainer, self.client, self.sink, self.controller, self.hub = trainer, client, sink, controller, hub
        self.overlap = self.rollout.mode == "async" and self.rollout.overlap_weight_push
        """The push of a version runs while the next batch trains."""
        self.in_flight: asyncio.Task | None = None
        """The overlapped push still running, if any."""
        self.hosts = isinstance(sink, HostsSink)
        """An engine on every host of a multi-process ``backend: local`` run (``HostsSink``)."""

    def describe(self) -> str:
        """The log line that says how this run pushes its weights."""
        rollout = self.rollout
        processes = self.hub.processes if self.hub is not None else 1
        if rollout.mode != "async":
            return "weight push: after each update, rollout idle (sync mode)"
        parts = ["overlapped with the next update" if rollout.overlap_weight_push else "before the next update"]
        if rollout.push_before_pause and getattr(self.sink, "can_hold", False) and not (
                rollout.overlap_weight_push and rollout.effective_max_staleness == 0):
            parts.append("held (sent while rollout generates, swapped in within one pause)")
        else:
            parts.append("between a pause and a continue")
        if self.hosts:
            parts.append(f"staged by each of {processes} processes into its own host's engine from its own gathers, "
                         "committed on every engine as one version")
        elif processes > 1 and rollout.overlap_weight_push and rollout.backend != "local":
            parts.append(f"gathered across {processes} processes onto process 0's host before the next update")
        return "weight push: " + ", ".join(parts)

    @property
    def _multi_process(self) -> bool:
        return self.hub is not None and self.hub.processes > 1

    @property
    def _hf_layout(self) -> bool:
        return not getattr(self.sink, "native_layout", False)  # our own servers over HTTP take our kernels untransposed

    # --- the step's side ------------------------------------------------------------------

    async def publish(self, version: int, step: int) -> None:
        """Push ``version``, the one just trained at ``step``, after the push before it: overlapped
        with the next update (``start``) or whole, now (``push``)."""
        await self.settle()  # one push at a time, in version order; raises what it raised
        if self.overlap:
            self.in_flight = await self.start(version, step)
        else:
            await self.push(version)

    async def settle(self) -> None:
        """Wait for the push in flight, if any; raises what it raised."""
        if self.in_flight is not None:
            pushing, self.in_flight = self.in_flight, None
            await pushing

    async def cancel(self) -> None:
        """The run failed: end the push in flight, if any, and swallow what it raises."""
        if self.in_flight is not None and not self.in_flight.done():
            self.in_flight.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.in_flight

    # --- the protocol ---------------------------------------------------------------------

    async def send(self, version: int, *, lent: Any = None, hold: bool = False, tensors: Any = None,
                   announce: bool = True) -> None:
        """Send the trainer's params, or ``lent`` (from ``policy.lend()``: params that outlive the
        next update, for a push that overlaps it), or ``tensors`` already gathered (``gather``), as
        ``version``; ``hold``: the servers serve it only at ``sink.commit(version)``. ``announce``:
        tell the other processes to take part in the gathers (not for a push the caller starts
        apart, whose gathering ``gather`` did)."""
        if self.hosts:  # ``tensors``: what ``gather`` staged (by URL, the engines that failed)
            failed = tensors if tensors is not None else await self._stage_on_hosts(version, announce)
            await self.sink.deliver(version, failed, hold=hold)
            return
        if self.rollout.backend == "local":  # device to device; shared: the engine keeps the trainer's arrays
            shared = self.rollout.local.placement == "shared"
            policy = self.trainer.policy
            await self.sink.push_params(version, lent if lent is not None else
                                        policy.lend() if shared else policy.params)
            return
        if tensors is not None:  # gathered already: only the sending is left
            await (self.sink.push(version, tensors, hold=True) if hold else self.sink.push(version, tensors))
            return
        hub = self.hub if announce else None
        hf_layout = self._hf_layout
        if hub is not None:
            await asyncio.to_thread(hub.announce, "push", version=version, hf_layout=hf_layout)
        tensors = iter_hf_tensors(self.trainer.model(lent), hf_layout=hf_layout)
        try:
            await (self.sink.push(version, tensors, hold=True) if hold else self.sink.push(version, tensors))
        finally:
            if hub is not None and hub.processes > 1:
                # The other processes gather every tensor with this one (collectives): a push that
                # stopped early (every server refused it) still has to finish the gathers.
                await asyncio.to_thread(collections.deque, tensors, 0)

    async def gather(self, version: int) -> Any:
        """A multi-process push's collective half, now: tell the other processes, gather every
        tensor with them and keep the whole model on this host; returns the tensors (over host
        arrays) for ``send(..., tensors=)`` to send later, while the next update runs. With an
        engine on every host, each host stages its copy now; returns the engines that failed."""
        if self.hosts:  # every host stages its own copy now; only the commit is left
            return await self._stage_on_hosts(version, True)
        hf_layout = self._hf_layout
        await asyncio.to_thread(self.hub.announce, "push", version=version, hf_layout=hf_layout)
        stream = iter_hf_tensors(self.trainer.model(), hf_layout=hf_layout)
        host = await asyncio.to_thread(list, stream)
        return HFTensorStream(iter(host), stream.layout, hf_layout=stream.hf_layout)

    async def _stage_on_hosts(self, version: int, announce: bool) -> dict[str, str]:
        """``HostsSink.stage`` with the followers told first (``announce``); by URL, the engines
        that failed."""
        if announce and self.hub is not None:
            await asyncio.to_thread(self.hub.announce, "push", version=version, hf_layout=False, hosts=True)
        return await self.sink.stage(version, iter_hf_tensors(self.trainer.model(), hf_layout=False))

    async def start(self, version: int, step: int) -> asyncio.Task:
        """Start pushing ``version`` from lent params (several processes: from tensors gathered now,
        see the module docstring), so the next update may run meanwhile, and return the push's
        task; the controller holds ``version`` from then on.

        A sample's staleness is that of its oldest token, and each token carries the version that
        made it, so the tokens the servers still make under the version before, until their pause
        lands, count as that older version and the bound holds. Only with ``max_staleness`` 0 would
        they make their samples too stale to train: then this returns once the servers have paused,
        and the controller takes the version at that moment."""
        lent = tensors = None
        if self._multi_process:
            tensors = await self.gather(version)
        else:
            lent = self.trainer.policy.lend()
        controller = self.controller
        if self.rollout.effective_max_staleness != 0:
            controller.set_version(version, step)
            return asyncio.create_task(self.push(version, lent=lent, tensors=tensors, announce=False))
        paused = asyncio.Event()

        def on_paused() -> None:
            controller.set_version(version, step)
            paused.set()

        task = asyncio.create_task(self.push(version, lent=lent, tensors=tensors, on_paused=on_paused,
                                             announce=False))
        waiting = asyncio.create_task(paused.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not paused.is_set():  # the push ended before the pause took: raise what it raised
            waiting.cancel()
            await task
        return task

    async def push(self, version: int, *, lent: Any = None, tensors: Any = None,
                   on_paused: Callable[[], None] | None = None, announce: bool = True) -> None:
        """The new weights to rollout as ``version``; in async mode between a pause (with abort) and
        a continue, so answers in flight resume under them (with ``rollout.interruptible: false``,
        after the episodes in flight have finished instead). With ``rollout.push_before_pause`` and
        a sink that can hold a version (HTTP buckets to our servers), the servers take it while they
        still generate, then each pauses, swaps it in and continues within one call
        (``sink.commit``); the tokens made meanwhile carry the version before. ``lent``: push these
        params, ``tensors``: send these, gathered already (see ``send``); ``on_paused`` is called
        once the servers have paused."""
        from rollout_bridge.client import WeightUpdateError

        rollout, client, sink, controller = self.rollout, self.client, self.sink, self.controller
        # Not when the caller waits for the pause (``max_staleness`` 0 overlapped): the pause comes
        # first there, so that the next update overlaps the transfer.
        hold = (rollout.mode == "async" and rollout.push_before_pause and getattr(sink, "can_hold", False)
                and on_paused is None)
        try:
            refused: WeightUpdateError | None = None
            if hold:
                try:
                    await self.send(version, lent=lent, hold=True, tensors=tensors, announce=announce)
                except WeightUpdateError as e:  # those that refused keep their weights; the others serve it
                    refused = e
            if rollout.mode == "async" and not rollout.interruptible:
                await controller.drain()
            if hold:
                if sink.held_version == version:  # some servers took it
                    await sink.commit(version, pause_mode=rollout.pause_mode)
                if refused is not None:
                    raise refused
                return
            if rollout.mode == "async":
                await client.pause(rollout.pause_mode)
            if on_paused is not None:
                on_paused()
            try:
                await self.send(version, lent=lent, tensors=tensors, announce=announce)
            finally:
                if rollout.mode == "async":
                    await client.continue_generation()
        except WeightUpdateError as e:
            # Servers that failed keep their old weights and stay out of rotation until a later push
            # reaches them; the run goes on while at least one server holds this version.
            if version not in client.server_versions().values():
                raise
            log.warning("weight push of version %d failed on some servers (out of rotation until they catch "
                        "up): %s", version, e)
        finally:
            if rollout.mode == "async":
                controller.resume()
