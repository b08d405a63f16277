"""One host's engine in a multi-process run with ``rollout.backend: local`` (a TPU pod slice, a
GPU cluster): ``EngineHost`` serves an ``Engine`` on this process's own chips (all of them with
the shared placement, its engine share with split) through the embedded server's app
(``server.build_app``, what ``areal-jax serve`` runs) on this process's event loop, beside the
process's other work, and takes new weights staged in this process.

Why every host, process 0's included, serves over HTTP: process 0 then routes over all the
engines with the one ``HttpRolloutClient`` that already routes, fails over and stamps every token
with the version that made it (its own engine too: its HTTP is on the loopback of one machine,
a small cost beside a decode step), and a weight version goes to every engine through the one
held-push protocol our servers already keep right: each host stages the version while it still
serves the one before (``hold``), and process 0's ``/commit_weights`` (inside its pause, or
with the commit's own) swaps it in under its label. A mixed client, one engine in process and
the others over HTTP, would need a second copy of the pause, version and stamp bookkeeping.

The weights never cross the network as bytes: every process runs the trainer's gathers (they
are collectives), keeps what they give, and stages it into its own engine (``hold``); only
the commit travels over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from rollout_bridge.server import build_app, start_server
from rollout_bridge.state import STATE
from rollout_bridge.weights_api import hold_stage

log = logging.getLogger(__name__)


def reachable_address(peer: str | None) -> str:
    """This host's address as ``peer`` (a host name or IP: the ``jax.distributed`` coordinator)
    reaches it: the local end of a route to it (a UDP socket's ``connect`` sends nothing); the
    host name's address when there is no peer or no route."""
    if peer:
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


class EngineHost:
    """An engine served over HTTP on the running event loop (see the module docstring);
    ``start`` it there, ``hold`` new weights from another thread, ``stop`` it on the loop."""

    def __init__(self, engine: Any, tokenizer: Any = None, *, api_key: str | None = None,
                 model_path: str | Path = "", process: int = 0):
        self.engine, self.process = engine, process
        self.app = build_app(engine, tokenizer, api_key, model_path=str(model_path),
                             info={"process_index": process, **engine.server_info()})
        self.url = ""
        self._runner: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int = 0) -> str:
        """Listen on ``host`` (``port`` 0: any free one) and start the engine; returns the URL."""
        self._loop = asyncio.get_running_loop()
        self._runner, bound = await start_server(self.app, host, port)
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        log.info("process %d: serving its engine (weights on devices %s) on %s", self.process, self.devices(), self.url)
        return self.url

    def devices(self) -> list[int]:
        """The ids of the devices the engine's weights are on (this host's engine share)."""
        import jax

        return sorted({d.id for x in jax.tree.leaves(self.engine._state) for d in x.devices()})

    async def stop(self) -> None:
        """Stop serving and stop the engine; logs the tokens it sampled under each label."""
        if self._runner is None:
            return
        runner, self._runner = self._runner, None
        log.info("process %d: its engine sampled %s", self.process, self.served())
        await runner.cleanup()

    def served(self) -> dict[str, int]:
        """Tokens this engine sampled, by the weight label they were stamped with."""
        st = self.app[STATE]
        out: dict[str, int] = {}
        for version, n in sorted(self.engine.tokens_by_version.items()):
            label = st.label_of(version)
            out[label] = out.get(label, 0) + n
        return out

    def hold(self, tensors: Iterable[tuple[str, np.ndarray]], transfer_id: str, label: str) -> str | None:
        """Stage ``tensors`` (``iter_hf_tensors``: the trainer's gathers, which every process of
        the run iterates in the same order) into the engine while it serves, and hold them as
        transfer ``transfer_id`` of ``label`` until ``/commit_weights``. Call from a thread other
        than the loop's. Every tensor is taken even after a failure (the gathers are collective);
        returns None, or what failed."""
        assert self._loop is not None, "start the host first"
        stage = self.engine.stage_weights(hf_layout=getattr(tensors, "hf_layout", True))
        error: str | None = None
        for name, arr in tensors:  # one tensor at a time: a parameter goes to the devices once whole
            if error is None:
                try:
                    stage.add({name: arr})
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
        if error is None:
            try:
                asyncio.run_coroutine_threadsafe(hold_stage(self.app[STATE], transfer_id, label, stage),
                                                 self._loop).result()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        if error is not None:
            log.error("process %d: could not stage weights %r for its engine: %s", self.process, label, error)
        return error
