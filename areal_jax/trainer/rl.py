"""The RL loop: ``train(config)`` ties data, rollout, rewards, the controller and the trainer
into one run, asynchronous (AReaL) or synchronous, and returns its metrics.

Each step takes a batch of groups from the controller (rollout keeps generating meanwhile),
runs the decoupled-PPO update (proximal logprobs recomputed, advantages, minibatch steps) in a
worker thread so the event loop keeps serving rollout, bumps the version, pushes the weights
(pause with abort, push, continue: answers in flight resume under the new weights; in async
mode the push overlaps the next batch's update), and logs. ``rl_steps.py`` holds the run object
and its steps, ``weight_push.py`` the push protocol; this module sets the run up.
A batch whose every optimizer step was skipped for a NaN/inf loss or gradient changed no weight:
its step is logged (``skipped_steps``) but the version is not bumped and nothing is pushed.
Evaluation runs on the held-out split after the warm start, every ``eval.every`` steps and at
the end. The run directory gets ``metrics.jsonl``, TensorBoard events, ``curves.png``, server
logs and the exported policy.

With ``checkpoint`` on, the run saves itself after a step every ``every_steps`` steps or
``every_seconds`` seconds and after the last one (see ``trainer/checkpoint.py``); ``resume=True``
(``areal-jax train ... --resume``) continues from the newest complete checkpoint: the trainer's
arrays, the version, the prompt iterator, the controller's counters and its pending prompts
(submitted again first), the host RNGs, and the metrics from the next step on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from areal_jax.controller import EpisodeClient, RolloutController, get_workflow
from areal_jax.trainer.metrics import MetricsLogger, plot_metrics
from areal_jax.trainer.model_dirs import base_dir, clear_tiny_base, prepare_model_dir, resume_model_dir
from areal_jax.trainer.rl_steps import Run, follow, held_out, run_steps
from areal_jax.trainer.rollout import (
    device_split,
    engine_beside_trainer,
    local_devices,
    open_rollout,
    servers_startup,
    start_engine_host,
    start_fleet_early,
)
from areal_jax.trainer.run_config import RunConfig, check_imports, load_run_config
from areal_jax.trainer.startup import StartupTimeline, process_age, use_compile_cache

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
          resume: bool = False, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Run RL from a ``RunConfig``, a YAML path or a dict; works inside a notebook's event loop.
    ``resume``: continue from the newest complete checkpoint (start afresh when there is none).
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
        in_a_loop = True
    except RuntimeError:
        in_a_loop = False
    if not in_a_loop:  # run outside the except block: else every error of the run shows "no running event loop"
        return asyncio.run(_train(config, resume, on_step))
    # A notebook already runs an event loop in this thread: run ours in another one.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(_train(config, resume, on_step))
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, name="areal-jax-train")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def first_batch_lengths(cfg: RunConfig, rows: list[Any]) -> list[int] | None:
    """The trajectory lengths of the longest first batch a single-turn run can get (every answer
    ``max_new_tokens`` long after the longest prompt), which ``Trainer.compile_first_step``
    compiles ahead; None where a workflow makes trajectories of other lengths."""
    if cfg.rollout.workflow != "single_turn" or not rows:
        return None
    n = max(len(r.prompt_ids) for r in rows) + cfg.rollout.max_new_tokens
    if cfg.train.max_seq_len is not None:
        n = min(n, cfg.train.max_seq_len)
    return [n] * (cfg.batch_size * cfg.rollout.group_size)


def _open_checkpoints(cfg: RunConfig, resume: bool) -> tuple[Any, dict[str, Any] | None]:
    """``(RunCheckpoints or None, the meta of the checkpoint to resume from or None)``."""
    if not (cfg.checkpoint.enabled or resume):
        return None, None
    from areal_jax.trainer.checkpoint import CheckpointError, RunCheckpoints, checkpoint_dir

    ckpts = RunCheckpoints(cfg.checkpoint, checkpoint_dir(cfg.checkpoint, cfg.run_dir))
    latest = ckpts.latest_step()
    if not resume:
        if latest is not None:
            earlier = ckpts.read_meta(latest)
            if latest < earlier.get("total_steps", latest + 1):  # an unfinished run: never thrown away unasked
                ckpts.close()
                raise CheckpointError(
                    f"{ckpts.directory} holds checkpoints of an unfinished run (step {latest} of "
                    f"{earlier.get('total_steps', '?')}): pass --resume (train(..., resume=True)) to continue it, "
                    "or remove them or set checkpoint.dir to start afresh")
            # A finished run's checkpoints go, as its metrics and exported policy are replaced.
            log.warning("starting afresh: removing the checkpoints of a finished run in %s", ckpts.directory)
            ckpts.delete_all()
        return ckpts, None
    if latest is None:
        log.warning("--resume: no complete checkpoint in %s; starting at step 0", ckpts.directory)
        return ckpts, None
    return ckpts, ckpts.read_meta(latest)


async def _train(cfg: RunConfig, resume: bool = False,
                 on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    from areal_jax.config import ConfigError
    from areal_jax.data import load_prompts, read_prompts
    from areal_jax.models import load_pretrained, load_tokenizer, save_pretrained
    from areal_jax.trainer import Trainer
    from areal_jax.trainer.multihost import StepHub
    from areal_jax.trainer.run_dir import RunDir
    from sharding import initialize_distributed, make_mesh

    t_start = time.perf_counter()
    timeline = StartupTimeline(t_start)
    age = process_age()
    if age is not None:
        timeline.add("process start and imports", t_start - age, t_start)
    t_checks = time.perf_counter()
    cache = use_compile_cache(cfg.compile_cache)  # before anything compiles; the servers get it too
    initialize_distributed(cfg.distributed)  # before this process uses any device
    hub = StepHub()
    files = RunDir(cfg.run_dir, cfg.local_dir)
    run_dir = files.local  # this process's own files; with a URL run_dir they are uploaded (files.publish)
    run_dir.mkdir(parents=True, exist_ok=True)
    if hub.leader:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        files.publish("config.yaml")
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    rollout = cfg.rollout
    check_imports(cfg)  # a bad workflow, agent or reward name fails before anything starts
    sandbox_line = cfg.reward.preflight()  # code rewards: no isolation fails here, before any model
    split = device_split(cfg)  # before this process's JAX starts: the trainer keeps its share only
    if split is not None:
        from rollout_bridge.placement import confine_this_process

        confine_this_process(split[0])
    local = rollout.backend == "local"
    # The local split placement trains on part of this process's devices and generates on the rest.
    # A mesh that does not fit the devices fails here, like a bad dataset below: before any model.
    devices = local_devices(cfg)[0] if local else None
    try:
        mesh = make_mesh(cfg.mesh, devices)
    except ValueError as e:
        raise ConfigError(f"mesh.data/fsdp/tensor: {e}") from None
    ckpts, meta = _open_checkpoints(cfg, resume)
    start = meta["step"] if meta is not None else 0
    timeline.add("config checks, mesh", t_checks)

    # A fresh run's rollout servers start once the prompts are read and checked (a bad dataset
    # fails before any server starts), in parallel with writing a tiny base model (embedded
    # servers import meanwhile and wait for it), tokenising the prompts, loading the model,
    # building the trainer and any warm start (whose weights reach them from disk once trained,
    # as version 0, before anything is generated).
    early = rewards = None
    try:
        # Process 0's controller draws every prompt, so no process takes a shard of the data; all of
        # them hold the same rows, which a warm start (trained by every process) needs.
        data_cfg = cfg.data if hub.processes == 1 else dataclasses.replace(cfg.data, process_index=0, process_count=1)
        with timeline.span("prompts read and checked"):
            read = read_prompts(data_cfg)
        if hub.leader:  # its worker processes start now, not when the evaluation before RL scores its first answer
            from areal_jax.rewards import RewardPool

            rewards = RewardPool(cfg.reward)
        if hub.leader and meta is None and cfg.model.path is None and cfg.rollout.backend == "embedded":
            early = start_fleet_early(cfg, clear_tiny_base(run_dir), run_dir / "logs", timeline, wait_for_model=True)
        # A tiny model is built once, by process 0, where every process reads it (the run directory);
        # with no shared filesystem (a URL run directory) every process builds (or downloads) its own.
        with timeline.span("base model written"):
            base = prepare_model_dir(cfg, run_dir) if hub.leader or files.remote else base_dir(cfg, run_dir)
        hub.barrier("base model ready")
        if early is None and hub.leader and meta is None:
            early = start_fleet_early(cfg, base, run_dir / "logs", timeline)
        with timeline.span("tokenizer, prompts tokenised"):
            tokenizer = load_tokenizer(base)
            data = load_prompts(data_cfg, tokenizer, read)
        if meta is None and files.remote and hub.leader:
            files.remove("tensorboard")  # an earlier run's events; the metrics file is replaced whole
        if meta is not None and files.remote:
            if cfg.warm_start is not None:
                files.fetch("warm_start")  # the KL reference, and what rollout served before the checkpoint's push
            if hub.leader:  # the metrics go on from the checkpoint's step
                files.fetch("metrics.jsonl")
                files.fetch("tensorboard")
        serve_dir = base if meta is None else resume_model_dir(cfg, run_dir, base)
        if meta is not None and hub.leader:  # a resumed run's servers start on what it served
            early = start_fleet_early(cfg, serve_dir, run_dir / "logs", timeline)
        with timeline.span("model loaded"):
            model = load_pretrained(serve_dir, mesh=mesh, dtype=cfg.model.dtype,
                                    attention_impl=cfg.model.attention_impl)
        logger = MetricsLogger(run_dir, cfg.log, total_steps=cfg.steps, run_config=cfg.to_dict(), start_step=start)
    except BaseException:
        if early is not None:
            early.stop()
        if rewards is not None:
            rewards.close()
        raise
    result = RunResult(run_dir=run_dir, metrics=logger.history)
    host = None  # this host's engine (``backend: local`` on several processes)
    if sandbox_line is not None:
        logger.write(sandbox_line)
    logger.write(f"compile cache: {cache} (compiled shapes are kept for the next run; compile_cache=null: none)"
                 if cache else "compile cache: none (every run compiles its shapes anew)")
    try:
        if cfg.warm_start is not None and meta is None:
            from areal_jax.trainer.sft import warm_start

            t0 = time.perf_counter()
            sft_stats = await asyncio.to_thread(warm_start, model, cfg.warm_start, tokenizer, data.train_rows,
                                                  train=cfg.train, mesh=mesh)
            serve_dir = save_pretrained(model, files.path("warm_start"), tokenizer_dir=base)
            if files.remote:  # rollout serves it from this host's disk
                serve_dir = files.fetch("warm_start") if hub.leader else run_dir / "warm_start"
            timeline.add("warm start (supervised), written", t0)
            logger.write(f"warm start: {sft_stats.get('steps', '?')} supervised steps in "
                         f"{time.perf_counter() - t0:.0f}s, loss {sft_stats.get('loss_first', float('nan')):.3f} -> "
                         f"{sft_stats.get('loss_last', float('nan')):.3f}")
        with timeline.span("trainer built"):
            trainer = Trainer(model, cfg.algo, cfg.train, mesh=mesh, **engine_beside_trainer(cfg, mesh))
        hub.row_owners = trainer.preparer.row_owners  # each follower gets its own share of a batch
        # No step left to take (``steps: 0``, or resumed from the last step's checkpoint): nothing
        # of a step is compiled ahead, and rollout generates nothing for one.
        steps_left = cfg.steps > start
        t_lent = time.perf_counter()
        if steps_left:
            trainer.policy.compile_lent_update()  # weight pushes lend the params; compiled meanwhile
        if trainer.policy._keep_compiled is not None:
            trainer.policy._keep_compiled.add_done_callback(
                lambda _: timeline.add("lent-params update compiled (background)", t_lent))
        from areal_jax.trainer.learner import describe_optimizer

        logger.write(describe_optimizer(cfg.train))
        auto = " (auto: 1024 on CPU, 8192 on GPU and TPU)" if cfg.train.micro_batch_tokens == "auto" else ""
        logger.write(f"train.micro_batch_tokens: {trainer.train.micro_batch_tokens}{auto}")
        if trainer.memory is not None:
            logger.write(trainer.memory.describe())
        if steps_left and cfg.train.compile_warmup:
            with timeline.span("trainer warm-up (train.compile_warmup)"):
                warm = await asyncio.to_thread(trainer.warmup)
            logger.write(f"trainer warm-up: {warm['shapes']:.0f} step shapes in {warm['seconds']:.1f}s "
                         f"({warm['compile_seconds']:.1f}s compiling)")
        elif steps_left and (lengths := first_batch_lengths(cfg, data.train_rows)) is not None and hub.processes == 1:
            # While rollout generates the first batch: step 1 then finds its shapes compiled.
            t_ahead = time.perf_counter()
            trainer.compile_first_step(lengths, cfg.rollout.group_size).add_done_callback(
                lambda _: timeline.add("first step compiled ahead (background)", t_ahead))
        if meta is not None:
            from areal_jax.trainer.checkpoint import set_rng_state

            trainer.load_checkpoint_state(ckpts.restore_state(start, trainer.checkpoint_state()), meta["trainer_step"],
                                          meta.get("critic_step"))
            set_rng_state(meta["rng"])
            t_start -= meta["time"]  # the metrics' wall time goes on from the checkpoint's
            logger.write(f"resuming from checkpoint step {start} in {ckpts.directory} (policy version "
                         f"{meta['version']}, {len(meta['controller']['pending'])} prompts in flight submitted again)")
        run = Run(cfg, hub, files, trainer, logger, data, tokenizer, base, ckpts=ckpts, meta=meta, start=start,
                  t_start=t_start, on_step=on_step, startup=timeline)
        if local and hub.processes > 1:  # an engine on every host, each served by its own process
            host = await start_engine_host(cfg, serve_dir, trainer.mesh, hub)
        if hub.leader:
            try:
                await _lead(run, serve_dir, rewards, early, host)
                result.eval_before, result.eval_after = run.eval_before, run.eval_after
            except BaseException as e:  # the followers wait for the next step: tell them why there is none
                if hub.processes > 1:
                    log.error("process 0: the run failed (%s: %s); stopping the other processes", type(e).__name__, e)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(asyncio.to_thread(hub.announce, "abort",
                                                                 error=f"{type(e).__name__}: {e}"[:2000]), 120)
                raise
            await asyncio.to_thread(hub.announce, "stop")
        else:
            await asyncio.to_thread(follow, hub, trainer, ckpts, host)
        if ckpts is not None:  # the last save completes (or its failure is raised) before the run ends
            ckpts, closing = None, ckpts
            closing.close()
        if cfg.export:  # every process takes part in the gathers; process 0 writes
            result.final_model = save_pretrained(trainer.model(), files.path("final"), tokenizer_dir=base)
        if logger.history:
            result.plot = plot_metrics(logger.history, run_dir / "curves.png", eval_before=result.eval_before)
    finally:
        if host is not None:  # after process 0 said stop: no one routes to it any more
            await host.stop()
        if early is not None and not early.taken:  # the run failed before its rollout opened
            early.stop()
        if rewards is not None:  # closed already where _lead ran
            rewards.close()
        if ckpts is not None:  # the run failed: let a save in progress finish, the first error stands
            with contextlib.suppress(Exception):
                ckpts.close()
        logger.close()
        if hub.leader and files.remote:  # failed or not: the metrics and server logs go up
            try:
                files.publish()
            except Exception as e:
                log.error("could not upload the run's files to %s: %s: %s", files, type(e).__name__, e)
    result.outputs = {"run_dir": str(files), "metrics": str(files.path("metrics.jsonl")),
                      "tensorboard": str(files.path("tensorboard")),
                      "plot": str(files.path("curves.png")) if result.plot else "None",
                      "final_model": str(result.final_model), "server_logs": str(files.path("logs"))}
    if cfg.checkpoint.enabled:
        from areal_jax.trainer.checkpoint import checkpoint_dir

        result.outputs["checkpoints"] = str(checkpoint_dir(cfg.checkpoint, cfg.run_dir))
    return result


async def _lead(run: Run, serve_dir: Path, rewards: Any, early: Any = None, host: Any = None) -> None:
    """Process 0's part of the run: open rollout (serving ``serve_dir``; ``early``: servers
    started already; ``host``: this host's engine, one of every host's), the weight push,
    evaluation and the controller over the ``rewards`` pool (closed here), then the steps (each
    announced to the other processes of a multi-process run)."""
    from areal_jax.trainer.weight_push import WeightPush, make_sink

    cfg, logger, meta = run.cfg, run.logger, run.meta
    rollout, local = cfg.rollout, cfg.rollout.backend == "local"
    run_dir = run.files.local
    hosts = None if host is None else (host, run.hub)
    t_open = time.perf_counter()
    async with open_rollout(cfg, serve_dir, run_dir / "logs", trainer_mesh=run.trainer.mesh,
                            early=early, hosts=hosts) as (client, fleet):
        run.startup.add("rollout opened (the servers answer /health)", t_open)
        if fleet is not None:
            run.startup.add_servers(await servers_startup(client))
        run.client, run.fleet = client, fleet
        where = (f"an engine on each of {len(client.servers)} hosts ({rollout.local.placement} placement, each "
                 f"served over HTTP by its own process: {', '.join(s.url for s in client.servers)})" if hosts
                 else f"an engine in this process ({rollout.local.placement} placement)" if local
                 else f"{len(client.servers)} server(s) ({rollout.backend})")
        logger.write(f"rollout: {where}, mode {rollout.mode}, max_staleness {rollout.effective_max_staleness}")
        for advice in cfg.advisories():
            if logger.enabled:
                logger.write(f"warning: {advice}")
            else:
                log.warning(advice)
        if not local and cfg.warm_start is not None and meta is None:  # they started on the base model
            with run.startup.span("warm-started weights loaded by the servers"):
                await client.update_weights_from_disk(str(serve_dir), version=0)
        sink = make_sink(cfg, client, run.trainer.model().config.to_hf_dict(), run_dir, run.base, hosts=hosts)
        run.weights = WeightPush(cfg, run.trainer, client, sink, hub=run.hub)
        logger.write(run.weights.describe())
        version = 0
        if meta is not None:  # rollout serves the restored policy from the start
            version = meta["version"]
            await run.weights.send(version)
        with rewards as pool:
            run.episodes = EpisodeClient(client, run.tokenizer, pool, rollout.sampling_params(),
                                         rollout.group_size, dict(rollout.workflow_options),
                                         batch_groups=rollout.batch_group_requests)
            if meta is None:
                # Before the controller starts: with an empty compile cache the evaluation's requests
                # compile the server's first shapes, and the first batch then finds them compiled
                # (0.13-0.37 s of wait on a loaded 2-core CPU); beside the batch's rollout, the mixed
                # traffic compiled more shapes (step 1 ended at a median 96 s after launch against 79 s).
                await eval_before_rl(run)
            if run.start >= cfg.steps:  # no step left: nothing to generate
                return
            run.controller = run.weights.controller = RolloutController(
                run.episodes, get_workflow(rollout.workflow), run.data.train_iter(), batch_size=cfg.batch_size,
                max_staleness=rollout.effective_max_staleness, max_concurrent=rollout.max_concurrent_rollouts,
                filter_uniform_reward=rollout.filter_uniform_reward, version=version, steps=run.start,
                failure_patience=rollout.failure_patience)
            if meta is not None:
                run.controller.load_state_dict(meta["controller"], {r.id: r for r in run.data.train_rows})
            run.controller.start()
            try:
                await run_steps(run)
                if logger.history and logger.history[-1].get("eval_accuracy") is not None:
                    run.eval_after = {k: v for k, v in logger.history[-1].items() if k.startswith("eval_")}
            finally:
                await run.controller.stop()


async def eval_before_rl(run: Run) -> None:
    """The held-out evaluation before RL (``run.eval_before``), logged when it ends."""
    with run.startup.span("held-out evaluation before RL"):
        result = await held_out(run)
    if result:
        result["time"] = time.perf_counter() - run.t_start
        run.logger.write(f"held-out accuracy before RL: {result['eval_accuracy']:.1%} "
                         f"({result['eval_prompts']} prompts)")
    run.eval_before = result


def run_summary(result: RunResult) -> str:
    """The lines ``areal-jax train`` prints at the end: results and where the outputs went."""
    lines = []
    if result.eval_before and result.eval_after:
        lines.append(f"held-out accuracy: {result.eval_before['eval_accuracy']:.1%} before RL -> "
                     f"{result.eval_after['eval_accuracy']:.1%} after {len(result.metrics)} steps")
    for k, v in result.outputs.items():
        lines.append(f"  {k:<12} {v}")
    return "\n".join(lines)


