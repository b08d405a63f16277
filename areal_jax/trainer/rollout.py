"""Rollout setup: ``open_rollout`` is the one place that turns the rollout config into a running
client: embedded servers started as child processes (stopped again on exit, and named when one
dies), the URLs of servers already running, ours or SGLang, or an engine inside this process
(``backend: local``, placed by ``local_devices``). ``device_split`` says which devices a
config's embedded servers take, before the trainer's JAX starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from areal_jax.trainer.run_config import RunConfig


def local_devices(cfg: RunConfig) -> tuple[list[Any], list[Any]]:
    """``(trainer devices, engine devices)`` of ``backend: local``: all of this process's
    devices for both (``shared``), or disjoint groups (``split``)."""
    import jax

    from rollout_bridge.local import split_devices

    if jax.process_count() > 1:
        raise ValueError("rollout.backend=local runs in one process; for several hosts use embedded or external "
                         "servers (rollout.backend=embedded or servers)")
    devices = jax.local_devices()
    if cfg.rollout.local.placement == "split":
        return split_devices(devices, cfg.rollout.local.engine_devices)
    return devices, devices


def _local_engine_mesh(cfg: RunConfig, trainer_mesh: Any) -> Any:
    """The in-process engine's mesh: the trainer's (shared; None on one device, which lets the
    engine run lanes), or ``rollout.local.engine_mesh`` over its own devices (split)."""
    from sharding import make_mesh

    _, devices = local_devices(cfg)
    if cfg.rollout.local.placement == "split":
        return make_mesh(cfg.rollout.local.engine_mesh, devices)
    mesh = trainer_mesh if trainer_mesh is not None else make_mesh(cfg.mesh, devices)
    return mesh if mesh.size > 1 else None


@contextlib.asynccontextmanager
async def open_rollout(cfg: RunConfig, serve_dir: Path, log_dir: Path,
                       trainer_mesh: Any = None) -> AsyncIterator[tuple[Any, Any]]:
    """``(client, fleet)``: an ``HttpRolloutClient`` on the configured servers, or with ``backend:
    local`` a ``LocalRolloutClient`` over an engine in this process (shared placement: on
    ``trainer_mesh``); ``fleet`` is the ``ServerFleet`` of embedded servers this started (else
    None)."""
    from rollout_bridge.client import HttpRolloutClient
    from rollout_bridge.launcher import ServerFleet

    rollout = cfg.rollout
    if rollout.backend == "local":
        from rollout_bridge.local import LocalRolloutClient, build_engine

        engine = await asyncio.to_thread(build_engine, serve_dir, rollout.server_args,
                                         mesh=_local_engine_mesh(cfg, trainer_mesh), seed=cfg.seed)
        async with LocalRolloutClient(engine) as client:
            yield client, None
        return
    fleet = None
    try:
        if rollout.backend in ("embedded", "sglang"):
            split = device_split(cfg)
            command = None
            if rollout.backend == "sglang":
                from rollout_bridge.sglang_launch import sglang_command

                def command(i: int, port: int) -> list[str]:
                    return sglang_command(rollout.sglang, str(serve_dir), port, seed=cfg.seed + i,
                                          api_key=rollout.api_key)
            fleet = ServerFleet(serve_dir, rollout.num_servers, log_dir, extra_args=rollout.server_args,
                                seed=cfg.seed, startup_timeout_s=rollout.startup_timeout_s, command=command,
                                weight_roots=[Path(serve_dir).absolute().parent, Path(cfg.run_dir).absolute(),
                                              *([rollout.weights_dir] if rollout.weights_dir else [])],
                                placements=split[1] if split else None, max_restarts=rollout.max_server_restarts)
            addresses = await asyncio.to_thread(fleet.start)
        else:
            addresses = list(rollout.servers)
        async with HttpRolloutClient(addresses, api_key=rollout.api_key) as client:
            yield client, fleet
    finally:
        if fleet is not None:
            fleet.stop()


def device_split(cfg: RunConfig) -> tuple[Any, list[Any]] | None:
    """``(trainer placement, server placements)`` from ``rollout.server_devices``, or None when
    the config splits nothing."""
    from rollout_bridge.placement import split_devices

    rollout = cfg.rollout
    if not rollout.server_devices or rollout.backend not in ("embedded", "sglang"):
        return None
    return split_devices(rollout.platform(), rollout.server_devices, rollout.num_servers)  # type: ignore[arg-type]
