"""The steps of an RL run (``rl.train`` sets the run up): the run object, ``Run``, and its loop,
``run_steps``. On process 0 each step takes a batch from the controller, trains on it in a worker
thread, pushes the new version (``trainer/weight_push.py``), logs its metrics, evaluates and
saves a checkpoint when due; ``follow`` is the other processes' part of a multi-process run, the
collective work process 0 announces.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.controller import EpisodeClient, RolloutController
from areal_jax.data.trajectory import Trajectory
from areal_jax.trainer.evaluate import evaluate
from areal_jax.trainer.metrics import MetricsLogger
from areal_jax.trainer.run_config import RunConfig
from areal_jax.trainer.startup import StartupTimeline
from areal_jax.trainer.weight_push import WeightPush, take_part

log = logging.getLogger(__name__)

_STAT_KEYS = ("loss", "clip_fraction", "dual_clip_fraction", "behavior_imp_weight_mean", "behavior_imp_weight_max",
              "dropped_fraction", "m2", "m2_dropped_fraction", "behavior_kl", "entropy", "grad_norm", "lr",
              "kl_ref_mean", "kl_loss", "value_loss")
"""The trainer's statistics a step logs (when finite)."""


@dataclass
class Run:
    """One RL run: what its steps read and write. ``rl.train`` fills the first part on every
    process; process 0 opens rollout (``rl._lead``) and fills the second, then runs the steps."""

    cfg: RunConfig
    hub: Any
    """The channel to the run's other processes (``trainer/multihost.py``; one process: no-ops)."""
    files: Any
    """The run directory (a ``RunDir``: ``files.local`` is this process's copy of it)."""
    trainer: Any
    logger: MetricsLogger
    data: Any
    """The prompts: ``train_rows``, ``eval_rows`` and ``train_iter()``."""
    tokenizer: Any
    base: Path
    """The base model's directory: its tokenizer and config, for the exported and pushed models."""
    ckpts: Any = None
    """The run's ``RunCheckpoints`` (None with checkpointing off)."""
    meta: dict[str, Any] | None = None
    """The checkpoint this run resumes from (None for a fresh run)."""
    start: int = 0
    """The step the run goes on from: steps ``start + 1 .. cfg.steps`` are left."""
    t_start: float = 0.0
    """``time.perf_counter()`` at the run's start (a resumed run: moved back by its time so far)."""
    on_step: Callable[[dict[str, Any]], None] | None = None
    startup: StartupTimeline = field(default_factory=StartupTimeline)
    """The run's start, span by span; step 1's metrics and the log carry it."""

    # Process 0, once rollout is open.
    client: Any = None
    """The rollout client: HTTP to servers, or the in-process engine's."""
    fleet: Any = None
    """The embedded servers this process started (None: none, or rollout in this process)."""
    weights: WeightPush | None = None
    """The weight sink and the push protocol."""
    episodes: EpisodeClient | None = None
    controller: RolloutController | None = None
    eval_before: dict[str, Any] | None = None
    eval_after: dict[str, Any] | None = None

    # The loop's own state.
    version: int = 0
    """The policy version of the trainer's weights."""
    _save_s: float | None = field(default=None, repr=False)
    _gen_tokens: int = field(default=0, repr=False)
    _t_last: float = field(default=0.0, repr=False)


@dataclass
class Batch:
    """One step's batch of groups and the step's timings so far."""

    step: int
    groups: list[Any]
    trajectories: list[Trajectory]
    staleness: list[int]
    t0: float
    """When the step began waiting for it."""
    wait_s: float
    train_s: float = 0.0
    sync_s: float = 0.0


async def run_steps(run: Run) -> None:
    """Steps ``run.start + 1 .. cfg.steps`` of a run (process 0), each logged through ``run.logger``."""
    run.version, run._save_s = run.controller.version, None
    run._gen_tokens, run._t_last = run.controller.counters.generated_tokens, time.perf_counter()
    try:
        for step in range(run.start + 1, run.cfg.steps + 1):
            batch = await next_batch(run, step)  # rollout keeps generating meanwhile
            stats = await update(run, batch)  # in a worker thread: the event loop keeps serving rollout
            await publish(run, batch, stats)  # the new version to rollout
            metrics = step_metrics(run, batch, stats)
            if (run.cfg.eval.every and step % run.cfg.eval.every == 0) or step == run.cfg.steps:
                await run.weights.settle()  # evaluate the version just trained
                metrics.update(await held_out(run))
            # What the servers hold now: this step's version, or with a push in flight the one before.
            metrics["served_versions"] = await served_versions(run.client)
            metrics["step_seconds"] = time.perf_counter() - batch.t0  # the whole step, its evaluation included
            if step == run.start + 1:  # where the start-up went: the first step waited for all of it
                first_step_spans(run, batch)
                metrics["startup"] = run.startup.as_dict()
                run.logger.write(run.startup.describe())
            run.logger.log(metrics)
            if run.ckpts is not None and run.ckpts.due(step, last=step == run.cfg.steps):
                await save(run, step, metrics["time"])
            if run.on_step is not None:
                run.on_step(metrics)
        await run.weights.settle()
    finally:
        await run.weights.cancel()  # the run failed: end the push in flight


async def next_batch(run: Run, step: int) -> Batch:
    """The next batch of groups from the controller, its trajectories numbered by group."""
    if run.fleet is not None:
        run.fleet.check()
    t0 = time.perf_counter()
    groups = await batch_or_dead_server(run.controller, run.fleet)
    wait_s = time.perf_counter() - t0
    trajectories = flatten_groups(groups)
    return Batch(step, groups, trajectories, [t.staleness(run.version) for t in trajectories], t0, wait_s)


async def update(run: Run, batch: Batch) -> dict[str, float]:
    """The decoupled-PPO update on ``batch`` (announced first to the other processes, which train
    on it too); returns the trainer's statistics."""
    t1 = time.perf_counter()
    await asyncio.to_thread(run.hub.announce, "train", step=batch.step, version=run.version,
                            trajectories=batch.trajectories, prompt_ids=[g.row_id for g in batch.groups])
    stats = await asyncio.to_thread(run.trainer.train_batch, batch.trajectories, run.version)
    batch.train_s = time.perf_counter() - t1
    return stats


async def publish(run: Run, batch: Batch, stats: dict[str, float]) -> None:
    """Bump the version and push it, unless every optimizer step of the batch was skipped; the
    controller then hands out the version rollout serves."""
    t2 = time.perf_counter()
    if int(stats.get("skipped_steps", 0)) >= run.cfg.algo.ppo_n_minibatches:
        # Every update of this batch had a NaN/inf and was skipped: the weights are the ones
        # rollout already serves, so there is no new version to push.
        run.logger.write(f"step {batch.step}: every optimizer step had a non-finite loss or gradient and was "
                         f"skipped; weights unchanged, version stays {run.version}, nothing pushed")
    else:
        run.version += 1
        await run.weights.publish(run.version, batch.step)
    batch.sync_s = time.perf_counter() - t2
    run.controller.set_version(run.version, batch.step)


def step_metrics(run: Run, batch: Batch, stats: dict[str, float]) -> dict[str, Any]:
    """The step's metrics, up to its evaluation and the versions the servers hold."""
    now = time.perf_counter()
    counters, trainer, trajectories = run.controller.counters, run.trainer, batch.trajectories
    metrics: dict[str, Any] = {
        "step": batch.step, "version": run.version, "time": now - run.t_start,
        # The trainer's wait for a full batch (rollout runs throughout, so in async mode
        # this is not generation time), then its update, then the weight push.
        "batch_wait_seconds": batch.wait_s, "train_seconds": batch.train_s, "weight_sync_seconds": batch.sync_s,
        "compile_seconds": float(stats.get("compile_seconds", 0.0)),
        "reward_mean": float(np.mean([t.reward for t in trajectories])),
        "staleness_max": int(max(batch.staleness)), "staleness_mean": float(np.mean(batch.staleness)),
        # Tokens generated since the last step over the wall time since then: the rate
        # rollout keeps up across the run, not one engine's decode speed.
        "gen_tokens_per_wall_s": (counters.generated_tokens - run._gen_tokens) / max(now - run._t_last, 1e-9),
        "train_tokens_per_s": stats.get("real_tokens", 0.0) / max(batch.train_s, 1e-9),
        "trajectories": len(trajectories),
        "answer_len_mean": float(np.mean([t.answer_len for t in trajectories])),
        "answer_len_max": int(max(t.answer_len for t in trajectories)),
        "filtered": counters.filtered, "failed": counters.failed, "stale_dropped": counters.stale_dropped,
        "stale_requeued": counters.stale_requeued, "stale_abandoned": counters.stale_abandoned,
        "reward_failures": run.episodes.reward_failures,
        "skipped_steps": int(stats.get("skipped_steps", 0)), "skipped_steps_total": trainer.skipped_steps,
        "prompt_ids": [g.row_id for g in batch.groups],
        "remat": trainer.policy.remat,
    }
    if trainer.memory is not None:
        metrics.update(trainer.memory.metrics())
    if run._save_s is not None:
        metrics["checkpoint_seconds"], run._save_s = run._save_s, None
    metrics.update({k: float(stats[k]) for k in _STAT_KEYS if k in stats and math.isfinite(stats[k])})
    run._gen_tokens, run._t_last = counters.generated_tokens, now
    return metrics


def first_step_spans(run: Run, batch: Batch) -> None:
    """Step 1's own spans on the run's start-up timeline: the wait for its batch, the update
    and the weight push."""
    t0 = batch.t0
    run.startup.add("first batch wait", t0, t0 + batch.wait_s)
    run.startup.add("first update (compiles included)", t0 + batch.wait_s, t0 + batch.wait_s + batch.train_s)
    t_push = t0 + batch.wait_s + batch.train_s
    run.startup.add("first weight push", t_push, t_push + batch.sync_s)


async def held_out(run: Run) -> dict[str, Any]:
    """Accuracy and mean reward on the held-out prompts, under the version rollout serves."""
    return await evaluate(run.episodes, run.data.eval_rows, run.cfg.eval, max_new_tokens=run.cfg.rollout.max_new_tokens)


async def save(run: Run, step: int, time_s: float) -> None:
    """A checkpoint after ``step`` (``time_s``: the run's time so far); a URL run directory gets
    the metrics too, so they are never behind the checkpoint a resume starts from."""
    from areal_jax.trainer.checkpoint import rng_state

    trainer = run.trainer
    # Taken between awaits: the controller's state matches the trainer's (batches 1..step).
    meta = {"step": step, "total_steps": run.cfg.steps, "version": run.version, "trainer_step": trainer.policy.step,
            "critic_step": None if trainer.critic_learner is None else trainer.critic_learner.step,
            "time": time_s, "controller": run.controller.state_dict(), "rng": rng_state()}
    meta = json.loads(json.dumps(meta))  # a copy that later steps cannot change under a background save
    await asyncio.to_thread(run.hub.announce, "save", step=step, meta=meta)
    run._save_s = await asyncio.to_thread(run.ckpts.save, step, trainer.checkpoint_state(), meta)
    if run.files is not None and run.files.remote:  # the log is flushed
        await asyncio.to_thread(run.files.publish, "metrics.jsonl", "tensorboard", "logs")


def follow(hub: Any, trainer: Any, ckpts: Any, host: Any = None) -> None:
    """A follower's part of a multi-process run (process 1 and up): the collective work process
    0 announces, step by step, until it stops the run. ``host``: this host's engine
    (``backend: local``), which a push stages its own copy of the weights into."""
    import jax

    me = jax.process_index()
    failed: Exception | None = None
    while True:
        message = hub.receive()
        op = message["op"]
        if op == "stop":
            return
        if op == "abort":
            raise RuntimeError(f"process 0 ended the run: {message['error']}") from failed
        try:
            if op == "train":
                trainer.train_batch(message["trajectories"], message["version"])
                log.info("process %d: step %d trained %d trajectories of prompts %s", me, message["step"],
                         len(message["trajectories"]), message["prompt_ids"])
            elif op == "push":  # take part in the gathers; process 0 sends the tensors, or each host keeps its own
                take_part(trainer, message.get("hf_layout", True), host=host if message.get("hosts") else None,
                          hub=hub, version=message.get("version", 0))
            elif op == "save":
                ckpts.save(message["step"], trainer.checkpoint_state(), message["meta"])
            else:
                raise RuntimeError(f"unknown message {op!r} from process 0")
        except Exception as e:
            # The same work most likely failed on process 0, which then says so: wait for its word
            # rather than leave it broadcasting to a process that is gone.
            log.error("process %d: %s failed (%s: %s); waiting for process 0 to end the run", me, op,
                      type(e).__name__, e)
            failed = e


def flatten_groups(groups: list[Any]) -> list[Trajectory]:
    """The trajectories of a batch's groups, each numbered by its group's place in the batch."""
    out = []
    for gid, g in enumerate(groups):
        for t in g.trajectories:
            t.group_id = gid
            out.append(t)
    return out


async def served_versions(client: Any) -> list[str] | None:
    """The weight version each server reports (our servers: the pushed number; SGLang: its label)."""
    try:
        return sorted(str(r["reply"].get("weight_version")) for r in await client.get_model_info()
                      if r["status"] == 200 and isinstance(r["reply"], dict))
    except Exception:  # informational only; a server hiccup here must not stop training
        return None


async def batch_or_dead_server(controller: RolloutController, fleet: Any) -> list[Any]:
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
