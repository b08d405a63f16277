"""Rollout setup: ``open_rollout`` is the one place that turns the rollout config into a running
client: embedded servers started as child processes (stopped again on exit, and named when one
dies), the URLs of servers already running, ours or SGLang, or an engine inside this process
(``backend: local``, placed by ``local_devices``; with several processes one on every host,
``start_engine_host``, each served over HTTP by its own process). ``device_split`` says which
devices a config's embedded servers take, before the trainer's JAX starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from areal_jax.trainer.run_config import RunConfig


def local_devices(cfg: RunConfig) -> tuple[list[Any], list[Any]]:
    """``(trainer devices, engine devices)`` of ``backend: local``: all of this process's
    devices for both (``shared``), or disjoint groups (``split``). With several processes the
    engine's are this host's (split: this host's engine share) and the trainer's are every
    host's (shared: all of them; split: each host's trainer share), so its mesh spans the run."""
    import jax

    from rollout_bridge.local import split_devices

    def split(devices: list[Any]) -> tuple[list[Any], list[Any]]:
        if cfg.rollout.local.placement == "split":
            return split_devices(devices, cfg.rollout.local.engine_devices)
        return devices, devices

    trainer, engine = split(jax.local_devices())
    if jax.process_count() > 1:
        hosts: dict[int, list[Any]] = {}
        for d in jax.devices():
            hosts.setdefault(d.process_index, []).append(d)
        trainer = [d for p in sorted(hosts) for d in split(hosts[p])[0]]
    return trainer, engine


def _processes() -> int:
    import jax

    return jax.process_count()


def engine_beside_trainer(cfg: RunConfig, trainer_mesh: Any) -> dict[str, Any]:
    """``Trainer`` arguments that plan an in-process engine beside the step: with ``backend:
    local`` and placement ``shared`` the engine's ``EngineConfig`` (from ``rollout.server_args``,
    as ``build_engine`` reads them), ``--dtype`` and mesh (the trainer's, or this host's on
    several processes, where the engine's projections are fused: ``start_engine_host``); else
    none."""
    rollout = cfg.rollout
    if rollout.backend != "local" or rollout.local.placement != "shared":
        return {}
    from areal_jax.inference.config import EngineConfig
    from rollout_bridge.serve import engine_config, parser

    args = parser().parse_args(["--model-path", "-", *rollout.server_args])
    mesh = _local_engine_mesh(cfg, trainer_mesh) if _processes() > 1 else trainer_mesh
    ways = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    engine = engine_config(args, args.context_length or EngineConfig.max_seq_len, data_parallel=ways > 1,
                           seed=cfg.seed)
    return {"engine": engine, "engine_dtype": args.dtype, "engine_mesh": mesh, "engine_fused": _processes() > 1}


def _local_engine_mesh(cfg: RunConfig, trainer_mesh: Any) -> Any:
    """The in-process engine's mesh: the trainer's (shared; None on one device, which lets the
    engine run lanes), or ``rollout.local.engine_mesh`` over its own devices (split). With
    several processes the engine is this host's, on this host's devices only: shared, a mesh
    like the trainer's over them (its ``tensor`` size where that fits, the rest ``fsdp``)."""
    from sharding import MeshConfig, make_mesh

    _, devices = local_devices(cfg)
    if cfg.rollout.local.placement == "split":
        return make_mesh(cfg.rollout.local.engine_mesh, devices)
    if _processes() > 1:  # a mesh even of one device: without one the engine would take the global device 0
        tensor = trainer_mesh.shape["tensor"] if trainer_mesh is not None else 1
        return make_mesh(MeshConfig(data=1, fsdp=-1, tensor=tensor if len(devices) % tensor == 0 else 1), devices)
    mesh = trainer_mesh if trainer_mesh is not None else make_mesh(cfg.mesh, devices)
    return mesh if mesh.size > 1 else None


async def start_engine_host(cfg: RunConfig, serve_dir: Path, trainer_mesh: Any, hub: Any) -> Any:
    """A multi-process run's engine on this host (``backend: local``, any process): built on
    this host's devices as placed (``_local_engine_mesh``), served over HTTP on this process's
    event loop (``rollout_bridge.hosts``) at the address that reaches the coordinator (or
    ``rollout.local.host``); a follower posts its URL for process 0 (``open_rollout`` collects them)."""
    import jax

    from areal_jax.models import load_tokenizer
    from areal_jax.trainer.multihost import coordinator_host
    from rollout_bridge.hosts import EngineHost, reachable_address
    from rollout_bridge.local import build_engine

    rollout = cfg.rollout
    mesh = _local_engine_mesh(cfg, trainer_mesh)
    # JAX's default device is the global device 0, on process 0's host: an array the engine makes
    # without a sharding must stay on this host's own engine devices.
    jax.config.update("jax_default_device", mesh.devices.flat[0])
    engine = await asyncio.to_thread(build_engine, serve_dir, rollout.server_args, mesh=mesh, seed=cfg.seed,
                                     fuse_projections=True)
    host = EngineHost(engine, load_tokenizer(serve_dir), api_key=rollout.api_key, model_path=serve_dir,
                      process=jax.process_index())
    await host.start(rollout.local.host or reachable_address(coordinator_host()))
    if not hub.leader:
        await asyncio.to_thread(hub.post, "engine", host.url)
    return host


class EarlyFleet:
    """Embedded (or SGLang) servers starting in a thread while the trainer loads and builds
    (``start_fleet_early``); ``open_rollout`` takes them over, or ``stop`` ends them if the run
    fails before it gets there."""

    def __init__(self, fleet: Any, task: asyncio.Future) -> None:
        self.fleet, self.task, self.taken = fleet, task, False

    def stop(self) -> None:
        """End the servers (again once their start returns, should it still be under way)."""
        self.fleet.stop()
        # The start then fails (its servers were stopped): the run's own error is the one to show.
        self.task.add_done_callback(lambda t: (self.fleet.stop(), t.cancelled() or t.exception()))


def start_fleet_early(cfg: RunConfig, serve_dir: Path, log_dir: Path, timeline: Any = None, *,
                      wait_for_model: bool = False) -> EarlyFleet | None:
    """Start the configured server processes now, in a thread, so that their start (a process
    importing JAX, loading the model, warming its engine) overlaps the trainer's own; None where
    the rollout has no processes of ours to start (``local``, or given ``servers``).
    ``wait_for_model``: ``serve_dir`` is still being written (embedded servers only): they import
    meanwhile and load it once its ``config.json`` appears, within ``rollout.startup_timeout_s``."""
    if cfg.rollout.backend not in ("embedded", "sglang"):
        return None
    if wait_for_model and cfg.rollout.backend != "embedded":
        raise ValueError("wait_for_model: only embedded servers (areal-jax serve) wait for their model")
    wait = ["--wait-for-model", f"{cfg.rollout.startup_timeout_s:g}"] if wait_for_model else []
    fleet = _make_fleet(cfg, serve_dir, log_dir, wait)

    launched = time.perf_counter()  # in the caller: the span starts when the run asked for them

    def start() -> list[str]:
        try:
            return fleet.start()
        finally:
            if timeline is not None:
                timeline.add("rollout servers started (process, imports, model load, /health)", launched)

    # run_in_executor starts the thread now, not at the caller's next await: the caller goes on
    # with blocking work (loading the model, building the trainer) meanwhile.
    return EarlyFleet(fleet, asyncio.get_running_loop().run_in_executor(None, start))


def _make_fleet(cfg: RunConfig, serve_dir: Path, log_dir: Path, extra_args: list[str] | None = None) -> Any:
    from areal_jax.trainer.startup import compile_cache_env
    from rollout_bridge.launcher import ServerFleet

    rollout = cfg.rollout
    split = device_split(cfg)
    command = None
    if rollout.backend == "sglang":
        from rollout_bridge.sglang_launch import sglang_command

        def command(i: int, port: int) -> list[str]:
            return sglang_command(rollout.sglang, str(serve_dir), port, seed=cfg.seed + i, api_key=rollout.api_key)
    return ServerFleet(serve_dir, rollout.num_servers, log_dir, extra_args=[*rollout.server_args, *(extra_args or [])],
                       seed=cfg.seed, startup_timeout_s=rollout.startup_timeout_s, command=command,
                       weight_roots=[Path(serve_dir).absolute().parent, local_run_dir(cfg).absolute(),
                                     *([rollout.weights_dir] if rollout.weights_dir else [])],
                       placements=split[1] if split else None, max_restarts=rollout.max_server_restarts,
                       env=compile_cache_env())  # the trainer's compilation cache


@contextlib.asynccontextmanager
async def open_rollout(cfg: RunConfig, serve_dir: Path, log_dir: Path, trainer_mesh: Any = None,
                       early: EarlyFleet | None = None, hosts: tuple[Any, Any] | None = None
                       ) -> AsyncIterator[tuple[Any, Any]]:
    """``(client, fleet)``: an ``HttpRolloutClient`` on the configured servers, or with ``backend:
    local`` a ``LocalRolloutClient`` over an engine in this process (shared placement: on
    ``trainer_mesh``); ``fleet`` is the ``ServerFleet`` of embedded servers this started (else
    None). ``early``: servers already starting (``start_fleet_early``), taken over here.
    ``hosts``: ``(this process's EngineHost, StepHub)`` of a multi-process ``backend: local``
    run: an ``HttpRolloutClient`` over every host's engine, this one's first."""
    from rollout_bridge.client import HttpRolloutClient

    rollout = cfg.rollout
    if hosts is not None:
        host, hub = hosts
        others = await asyncio.to_thread(hub.collect, "engine", rollout.startup_timeout_s)
        async with HttpRolloutClient([host.url, *others], api_key=rollout.api_key) as client:
            yield client, None
        return
    if rollout.backend == "local":
        from rollout_bridge.local import LocalRolloutClient, build_engine

        engine = await asyncio.to_thread(build_engine, serve_dir, rollout.server_args,
                                         mesh=_local_engine_mesh(cfg, trainer_mesh), seed=cfg.seed)
        async with LocalRolloutClient(engine) as client:
            yield client, None
        return
    fleet = None
    try:
        if early is not None:
            early.taken, fleet = True, early.fleet
            addresses = await early.task
        elif rollout.backend in ("embedded", "sglang"):
            fleet = _make_fleet(cfg, serve_dir, log_dir)
            addresses = await asyncio.to_thread(fleet.start)
        else:
            addresses = list(rollout.servers)
        async with HttpRolloutClient(addresses, api_key=rollout.api_key) as client:
            yield client, fleet
    finally:
        if fleet is not None:
            fleet.stop()


async def servers_startup(client: Any) -> list[dict[str, Any] | None]:
    """Each server's account of its own start (``startup_seconds`` in ``/get_server_info``'s
    ``internal_states``: the interpreter and imports, then the model and engine), None for a
    server that gives none (SGLang) or does not answer; empty for a rollout without HTTP servers."""
    pool = getattr(client, "pool", None)
    if pool is None:
        return []

    async def one(server: Any) -> dict[str, Any] | None:
        try:
            status, body = await pool.request(server, "GET", "/get_server_info", timeout=pool.cfg.control_timeout_s)
        except Exception:  # informational only
            return None
        states = body.get("internal_states") if status == 200 and isinstance(body, dict) else None
        return states[0].get("startup_seconds") if states and isinstance(states[0], dict) else None

    return list(await asyncio.gather(*(one(s) for s in pool.servers)))


def local_run_dir(cfg: RunConfig) -> Path:
    """This process's own directory of the run (the run directory itself, unless it is a URL)."""
    from areal_jax.trainer import run_dir

    return run_dir.local_run_dir(cfg.run_dir, cfg.local_dir)


def device_split(cfg: RunConfig) -> tuple[Any, list[Any]] | None:
    """``(trainer placement, server placements)`` from ``rollout.server_devices``, or None when
    the config splits nothing."""
    from rollout_bridge.placement import split_devices

    rollout = cfg.rollout
    if not rollout.server_devices or rollout.backend not in ("embedded", "sglang"):
        return None
    return split_devices(rollout.platform(), rollout.server_devices, rollout.num_servers)  # type: ignore[arg-type]
