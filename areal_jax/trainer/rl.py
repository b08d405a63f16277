"""The RL loop: ``train(config)`` ties data, rollout, rewards, the controller and the trainer
into one run, asynchronous (AReaL) or synchronous, and returns its metrics.

Each step takes a batch of groups from the controller (rollout keeps generating meanwhile),
runs the decoupled-PPO update (proximal logprobs recomputed, advantages, minibatch steps) in a
worker thread so the event loop keeps serving rollout, bumps the version, pushes the weights
(pause with abort, push, continue: answers in flight resume under the new weights), and logs.
Evaluation runs on the held-out split after the warm start, every ``eval.every`` steps and at
the end. The run directory gets ``metrics.jsonl``, TensorBoard events, ``curves.png``, server
logs and the exported policy.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from areal_jax.controller import EpisodeClient, RolloutController, get_workflow
from areal_jax.data.trajectory import Trajectory
from areal_jax.trainer.evaluate import evaluate, local_devices, open_rollout
from areal_jax.trainer.metrics import MetricsLogger, plot_metrics
from areal_jax.trainer.run_config import RunConfig, load_run_config

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What ``train`` returns: the per-step metrics and where the outputs went."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    eval_before: dict[str, Any] | None = None
    """Held-out evaluation before RL (after the warm start, if any)."""
    eval_after: dict[str, Any] | None = None
    final_model: Path | None = None
    plot: Path | None = None
    outputs: dict[str, str] = field(default_factory=dict)


def train(config: RunConfig | str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *,
          on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Run RL from a ``RunConfig``, a YAML path or a dict; works inside a notebook's event loop.
    ``on_step`` is called with each step's metrics as soon as the step (evaluation included) ends."""
    if isinstance(config, dict):
        from areal_jax.config import from_dict, merge, parse_overrides

        config = from_dict(RunConfig, merge(config, parse_overrides(overrides)))
    elif not isinstance(config, RunConfig):
        config = load_run_config(config, overrides)
    elif overrides:
        raise ValueError("overrides apply to a config file or dict; edit the RunConfig with dataclasses.replace")
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_train(config, on_step))
    # A notebook already runs an event loop in this thread: run ours in another one.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(_train(config, on_step))
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, name="areal-jax-train")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def prepare_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """The base model directory: ``model.path``, or a tiny model built in ``<run dir>/base`` (anew
    each run, so a changed ``model`` section never meets a stale checkpoint; it takes a second)."""
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path={path}: no config.json there; point it at a HF model directory")
        return path
    from areal_jax.models.tiny import make_tiny_checkpoint

    base = run_dir / "base"
    if base.exists():
        shutil.rmtree(base)
    make_tiny_checkpoint(base, model_type=cfg.model.model_type, size=cfg.model.tiny, seed=cfg.seed,
                         **cfg.model.tiny_options)
    return base


def _flatten(groups: list[Any]) -> list[Trajectory]:
    out = []
    for gid, g in enumerate(groups):
        for t in g.trajectories:
            t.group_id = gid
            out.append(t)
    return out


async def _train(cfg: RunConfig, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    from areal_jax.data import load_prompts
    from areal_jax.models import iter_hf_tensors, load_pretrained, load_tokenizer, save_pretrained
    from areal_jax.rewards import RewardPool
    from areal_jax.trainer import Trainer
    from rollout_bridge.streamer import DiskSink, HttpBucketSink, LocalSink
    from sharding import make_mesh

    t_start = time.perf_counter()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    rollout = cfg.rollout
    workflow = get_workflow(rollout.workflow)  # a bad name fails before anything starts

    base = prepare_model_dir(cfg, run_dir)
    tokenizer = load_tokenizer(base)
    data = load_prompts(cfg.data, tokenizer)
    local = rollout.backend == "local"
    # The local split placement trains on part of this process's devices and generates on the rest.
    mesh = make_mesh(cfg.mesh, local_devices(cfg)[0] if local else None)
    model = load_pretrained(base, mesh=mesh, dtype=cfg.model.dtype, attention_impl=cfg.model.attention_impl)
    serve_dir = base
    logger = MetricsLogger(run_dir, cfg.log, total_steps=cfg.steps, run_config=cfg.to_dict())
    result = RunResult(run_dir=run_dir, metrics=logger.history)
    try:
        if cfg.warm_start is not None:
            from areal_jax.trainer.sft import warm_start

            t0 = time.perf_counter()
            sft_stats = await asyncio.to_thread(warm_start, model, cfg.warm_start, tokenizer, data.train_rows)
            serve_dir = save_pretrained(model, run_dir / "warm_start", tokenizer_dir=base)
            logger.write(f"warm start: {sft_stats.get('steps', '?')} supervised steps in "
                         f"{time.perf_counter() - t0:.0f}s, loss {sft_stats.get('loss_first', float('nan')):.3f} -> "
                         f"{sft_stats.get('loss_last', float('nan')):.3f}")
        trainer = Trainer(model, cfg.algo, cfg.train, mesh=mesh)
        async with open_rollout(cfg, serve_dir, run_dir / "logs", trainer_mesh=mesh) as (client, fleet):
            where = (f"an engine in this process ({rollout.local.placement} placement)" if local
                     else f"{len(client.servers)} server(s) ({rollout.backend})")
            logger.write(f"rollout: {where}, mode {rollout.mode}, max_staleness {rollout.effective_max_staleness}")
            if rollout.backend == "servers" and cfg.warm_start is not None:
                await client.update_weights_from_disk(str(serve_dir), version=0)
            sink = (LocalSink(client) if local else HttpBucketSink(client) if rollout.weight_sync == "http" else
                    DiskSink(run_dir / "weights", model.config.to_hf_dict(), client=client, tokenizer_dir=base))
            with RewardPool(cfg.reward) as pool:
                episode_client = EpisodeClient(client, tokenizer, pool, rollout.sampling_params(),
                                               rollout.group_size, dict(rollout.workflow_options))
                result.eval_before = await evaluate(episode_client, data.eval_rows, cfg.eval,
                                                    max_new_tokens=rollout.max_new_tokens)
                if result.eval_before:
                    result.eval_before["time"] = time.perf_counter() - t_start
                    logger.write(f"held-out accuracy before RL: {result.eval_before['eval_accuracy']:.1%} "
                                 f"({result.eval_before['eval_prompts']} prompts)")
                controller = RolloutController(
                    episode_client, workflow, data.train_iter(), batch_size=cfg.batch_size,
                    max_staleness=rollout.effective_max_staleness, max_concurrent=rollout.max_concurrent_rollouts,
                    filter_uniform_reward=rollout.filter_uniform_reward)
                controller.start()
                try:
                    await _loop(cfg, trainer, controller, client, sink, episode_client, data, logger, fleet,
                                t_start, iter_hf_tensors, result, on_step)
                finally:
                    await controller.stop()
        if cfg.export:  # every process takes part in the gathers; process 0 writes
            result.final_model = save_pretrained(trainer.model(), run_dir / "final", tokenizer_dir=base)
        if logger.history:
            result.plot = plot_metrics(logger.history, run_dir / "curves.png", eval_before=result.eval_before)
    finally:
        logger.close()
    result.outputs = {"run_dir": str(run_dir), "metrics": str(logger.path),
                      "tensorboard": str(run_dir / "tensorboard"), "plot": str(result.plot),
                      "final_model": str(result.final_model), "server_logs": str(run_dir / "logs")}
    return result


async def _loop(cfg: RunConfig, trainer: Any, controller: RolloutController, client: Any, sink: Any,
                episode_client: EpisodeClient, data: Any, logger: MetricsLogger, fleet: Any, t_start: float,
                iter_hf_tensors: Any, result: RunResult,
                on_step: Callable[[dict[str, Any]], None] | None = None) -> None:
    rollout = cfg.rollout
    version = 0
    gen_tokens = controller.counters.generated_tokens
    t_last = time.perf_counter()
    for step in range(1, cfg.steps + 1):
        if fleet is not None:
            fleet.check()
        t0 = time.perf_counter()
        groups = await _batch_or_dead_server(controller, fleet)
        rollout_s = time.perf_counter() - t0
        trajectories = _flatten(groups)
        staleness = [t.staleness(version) for t in trajectories]
        t1 = time.perf_counter()
        stats = await asyncio.to_thread(trainer.train_batch, trajectories, version)
        train_s = time.perf_counter() - t1
        version += 1
        t2 = time.perf_counter()
        if rollout.mode == "async":
            if not rollout.interruptible:
                await controller.drain()
            await client.pause(rollout.pause_mode)
        try:
            if rollout.backend == "local":  # device to device; shared: the engine keeps the trainer's arrays
                shared = rollout.local.placement == "shared"
                await sink.push_params(version, trainer.lend_params() if shared else trainer.params)
            else:
                await sink.push(version, iter_hf_tensors(trainer.model()))
        finally:
            if rollout.mode == "async":
                await client.continue_generation()
                controller.resume()
        sync_s = time.perf_counter() - t2
        controller.set_version(version)
        served = await _served_versions(client)
        now = time.perf_counter()
        counters = controller.counters
        metrics: dict[str, Any] = {
            "step": step, "version": version, "time": now - t_start,
            "rollout_seconds": rollout_s, "train_seconds": train_s, "weight_sync_seconds": sync_s,
            "reward_mean": float(np.mean([t.reward for t in trajectories])),
            "staleness_max": int(max(staleness)), "staleness_mean": float(np.mean(staleness)),
            "gen_tokens_per_s": (counters.generated_tokens - gen_tokens) / max(now - t_last, 1e-9),
            "train_tokens_per_s": stats.get("real_tokens", 0.0) / max(train_s, 1e-9),
            "trajectories": len(trajectories),
            "answer_len_mean": float(np.mean([t.answer_len for t in trajectories])),
            "answer_len_max": int(max(t.answer_len for t in trajectories)),
            "filtered": counters.filtered, "failed": counters.failed, "stale_dropped": counters.stale_dropped,
            "reward_failures": episode_client.reward_failures,
            "served_versions": served,
        }
        for k in ("loss", "clip_fraction", "dual_clip_fraction", "behavior_imp_weight_mean",
                  "behavior_imp_weight_max", "dropped_fraction", "behavior_kl", "entropy", "grad_norm", "lr",
                  "kl_ref_mean", "value_loss"):
            if k in stats and math.isfinite(stats[k]):
                metrics[k] = float(stats[k])
        gen_tokens, t_last = counters.generated_tokens, now
        if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps:
            metrics.update(await evaluate(episode_client, data.eval_rows, cfg.eval,
                                          max_new_tokens=rollout.max_new_tokens))
        logger.log(metrics)
        if on_step is not None:
            on_step(metrics)
    if logger.history and logger.history[-1].get("eval_accuracy") is not None:
        result.eval_after = {k: v for k, v in logger.history[-1].items() if k.startswith("eval_")}


async def _served_versions(client: Any) -> list[str] | None:
    """The weight version each server reports (our servers: the pushed number; SGLang: its label)."""
    try:
        return sorted(str(r["reply"].get("weight_version")) for r in await client.get_model_info()
                      if r["status"] == 200 and isinstance(r["reply"], dict))
    except Exception:  # informational only; a server hiccup here must not stop training
        return None


async def _batch_or_dead_server(controller: RolloutController, fleet: Any) -> list[Any]:
    """Wait for a batch, checking now and then that every embedded server is still alive."""
    task = asyncio.ensure_future(controller.get_batch())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=2.0)
            if done:
                return task.result()
            if fleet is not None:
                fleet.check()
    finally:
        if not task.done():
            task.cancel()


def run_summary(result: RunResult) -> str:
    """The lines ``areal-jax train`` prints at the end: results and where the outputs went."""
    lines = []
    if result.eval_before and result.eval_after:
        lines.append(f"held-out accuracy: {result.eval_before['eval_accuracy']:.1%} before RL -> "
                     f"{result.eval_after['eval_accuracy']:.1%} after {len(result.metrics)} steps")
    for k, v in result.outputs.items():
        lines.append(f"  {k:<12} {v}")
    return "\n".join(lines)


