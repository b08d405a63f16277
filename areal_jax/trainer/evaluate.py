"""Held-out evaluation: accuracy and mean reward of the served policy on the eval split, during a
run (``evaluate``) or for a saved checkpoint (``evaluate_checkpoint``, ``areal-jax eval``).

``open_rollout`` is the one place that turns the rollout config into a running client: embedded
servers started as child processes (stopped again on exit, and named when one dies), the
URLs of servers already running, ours or SGLang, or an engine inside this process
(``backend: local``, placed by ``local_devices``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.controller import EpisodeClient
from areal_jax.trainer.run_config import EvalConfig, RunConfig


async def evaluate(client: EpisodeClient, rows: list[Any], cfg: EvalConfig, *, max_new_tokens: int,
                   concurrency: int = 64) -> dict[str, Any]:
    """Accuracy (reward >= ``correct_threshold``) and mean reward on ``rows``."""
    rows = rows[: cfg.max_prompts] if cfg.max_prompts else rows
    if not rows:
        return {}
    sem = asyncio.Semaphore(concurrency)
    overrides: dict[str, Any] = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens or max_new_tokens}
    if cfg.temperature == 0:
        overrides.update(top_p=1.0, top_k=-1)

    async def one(row: Any) -> float:
        async with sem:
            result = await client.generate(row.prompt_ids, **overrides)
            return await client.reward(row, client.decode(result.output_ids))

    t0 = time.perf_counter()
    rewards = np.array(await asyncio.gather(*(one(r) for r in rows)))
    return {"eval_accuracy": float(np.mean(rewards >= cfg.correct_threshold)), "eval_reward": float(rewards.mean()),
            "eval_prompts": len(rows), "eval_seconds": time.perf_counter() - t0}


def local_devices(cfg: RunConfig) -> tuple[list[Any], list[Any]]:
    """``(trainer devices, engine devices)`` of ``backend: local``: all of this process's
    devices for both (``shared``), or disjoint groups (``split``)."""
    import jax

    from rollout_bridge.local import split_devices

    if jax.process_count() > 1:
        from areal_jax.config import ConfigError

        raise ConfigError(f"rollout.backend=local runs its engine inside one process, and this run has "
                          f"{jax.process_count()} processes: on several hosts use rollout.backend=embedded or servers "
                          "(an engine on every host's chips is not built yet; BUILD.md, 'A TPU pod')")
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


class EarlyFleet:
    """Embedded (or SGLang) servers starting in a thread while the trainer loads and builds
    (``start_fleet_early``); ``open_rollout`` takes them over, or ``stop`` ends them if the run
    fails before it gets there."""

    def __init__(self, fleet: Any, task: asyncio.Future) -> None:
        self.fleet, self.task, self.taken = fleet, task, False

    def stop(self) -> None:
        """End the servers (again once their start returns, should it still be under way)."""
        self.fleet.stop()
        self.task.add_done_callback(lambda _: self.fleet.stop())


def start_fleet_early(cfg: RunConfig, serve_dir: Path, log_dir: Path) -> EarlyFleet | None:
    """Start the configured server processes now, in a thread, so that their start (a process
    importing JAX, loading the model, warming its engine) overlaps the trainer's own; None where
    the rollout has no processes of ours to start (``local``, or given ``servers``)."""
    if cfg.rollout.backend not in ("embedded", "sglang"):
        return None
    fleet = _make_fleet(cfg, serve_dir, log_dir)
    # run_in_executor starts the thread now, not at the caller's next await: the caller goes on
    # with blocking work (loading the model, building the trainer) meanwhile.
    return EarlyFleet(fleet, asyncio.get_running_loop().run_in_executor(None, fleet.start))


def _make_fleet(cfg: RunConfig, serve_dir: Path, log_dir: Path) -> Any:
    from rollout_bridge.launcher import ServerFleet

    rollout = cfg.rollout
    split = device_split(cfg)
    command = None
    if rollout.backend == "sglang":
        from rollout_bridge.sglang_launch import sglang_command

        def command(i: int, port: int) -> list[str]:
            return sglang_command(rollout.sglang, str(serve_dir), port, seed=cfg.seed + i, api_key=rollout.api_key)
    return ServerFleet(serve_dir, rollout.num_servers, log_dir, extra_args=rollout.server_args,
                       seed=cfg.seed, startup_timeout_s=rollout.startup_timeout_s, command=command,
                       weight_roots=[Path(serve_dir).absolute().parent, _local_run_dir(cfg).absolute(),
                                     *([rollout.weights_dir] if rollout.weights_dir else [])],
                       placements=split[1] if split else None, max_restarts=rollout.max_server_restarts)


@contextlib.asynccontextmanager
async def open_rollout(cfg: RunConfig, serve_dir: Path, log_dir: Path,
                       trainer_mesh: Any = None, early: EarlyFleet | None = None) -> AsyncIterator[tuple[Any, Any]]:
    """``(client, fleet)``: an ``HttpRolloutClient`` on the configured servers, or with ``backend:
    local`` a ``LocalRolloutClient`` over an engine in this process (shared placement: on
    ``trainer_mesh``); ``fleet`` is the ``ServerFleet`` of embedded servers this started (else
    None). ``early``: servers already starting (``start_fleet_early``), taken over here."""
    from rollout_bridge.client import HttpRolloutClient

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


def _local_run_dir(cfg: RunConfig) -> Path:
    """This process's own directory of the run (the run directory itself, unless it is a URL)."""
    from areal_jax.trainer.run_dir import local_run_dir

    return local_run_dir(cfg.run_dir, cfg.local_dir)


def device_split(cfg: RunConfig) -> tuple[Any, list[Any]] | None:
    """``(trainer placement, server placements)`` from ``rollout.server_devices``, or None when
    the config splits nothing."""
    from rollout_bridge.placement import split_devices

    rollout = cfg.rollout
    if not rollout.server_devices or rollout.backend not in ("embedded", "sglang"):
        return None
    return split_devices(rollout.platform(), rollout.server_devices, rollout.num_servers)  # type: ignore[arg-type]


def evaluate_checkpoint(cfg: RunConfig, model_path: str | Path) -> dict[str, Any]:
    """Serve ``model_path`` as the config's rollout says and evaluate it on the eval split."""
    from areal_jax.config import ConfigError
    from areal_jax.data import load_prompts
    from areal_jax.models import load_tokenizer
    from areal_jax.rewards import RewardPool

    model_path = Path(model_path)
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"--model-path {model_path}: no config.json; point it at a HF model directory "
                                "(e.g. <run dir>/final)")
    tokenizer = load_tokenizer(model_path)
    data = load_prompts(cfg.data, tokenizer)
    if not data.eval_rows:
        raise ConfigError("the config's data section has no held-out split (set data.eval_path or data.eval_fraction)")

    async def run() -> dict[str, Any]:
        async with open_rollout(cfg, model_path, _local_run_dir(cfg) / "logs-eval") as (client, _):
            if cfg.rollout.backend == "servers":
                await client.update_weights_from_disk(str(model_path), version=0)
            with RewardPool(cfg.reward) as pool:
                ep = EpisodeClient(client, tokenizer, pool, cfg.rollout.sampling_params())
                return await evaluate(ep, data.eval_rows, cfg.eval, max_new_tokens=cfg.rollout.max_new_tokens)

    return asyncio.run(run())
