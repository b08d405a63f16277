"""The steps of an RL run (``rl.train`` sets the run up): on process 0, each batch from the
controller, its update in a worker thread, the push of the new version, metrics, evaluation and
checkpoints; on the other processes of a multi-process run, their part of the collective work.

In async mode the push of a version overlaps the next batch's update
(``rollout.overlap_weight_push``): the controller holds the new version at once (see
``start_push`` for why the staleness bound still holds), and the push streams from params the
trainer lent, which that update leaves alone. A step that evaluates waits for its push, so
held-out accuracy is always the version just trained.

In a run of several processes every weight gather is a collective that all of them enter in
the same order as the train steps around it, while only process 0 holds the rollout client. A
plain push streams: each tensor is gathered (every process) and sent (process 0) in turn. An
overlapped push cannot gather while the next update runs (the two would interleave differently
on each process), so it gathers every tensor first, in the run's order, onto process 0's host
(one copy of the model in the push dtype there), and only the sending, which is most of a
push's time, overlaps the next update. A held push (``push_before_pause``) is the same push
sent before the pause, so it works as either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from areal_jax.controller import EpisodeClient, RolloutController
from areal_jax.data.trajectory import Trajectory
from areal_jax.trainer.evaluate import evaluate
from areal_jax.trainer.metrics import MetricsLogger
from areal_jax.trainer.run_config import RunConfig

log = logging.getLogger(__name__)


def flatten_groups(groups: list[Any]) -> list[Trajectory]:
    """The trajectories of a batch's groups, each numbered by its group's place in the batch."""
    out = []
    for gid, g in enumerate(groups):
        for t in g.trajectories:
            t.group_id = gid
            out.append(t)
    return out


def describe_push(cfg: RunConfig, sink: Any, processes: int) -> str:
    """The log line that says how this run pushes its weights."""
    rollout = cfg.rollout
    if rollout.mode != "async":
        return "weight push: after each update, rollout idle (sync mode)"
    parts = ["overlapped with the next update" if rollout.overlap_weight_push else "before the next update"]
    if rollout.push_before_pause and getattr(sink, "can_hold", False) and not (
            rollout.overlap_weight_push and rollout.effective_max_staleness == 0):
        parts.append("held (sent while rollout generates, swapped in within one pause)")
    else:
        parts.append("between a pause and a continue")
    if processes > 1 and rollout.overlap_weight_push and rollout.backend != "local":
        parts.append(f"gathered across {processes} processes onto process 0's host before the next update")
    return "weight push: " + ", ".join(parts)


def multi_process(hub: Any) -> bool:
    return hub is not None and hub.processes > 1


async def gather_push(trainer: Any, sink: Any, version: int, iter_hf_tensors: Any, hub: Any) -> Any:
    """A multi-process push's collective half, now: tell the other processes, gather every
    tensor with them and keep the whole model on this host; returns the tensors (an
    ``HFTensorStream`` over host arrays) for ``push_weights(..., tensors=)`` to send later,
    while the next update runs."""
    from areal_jax.models.hf_io import HFTensorStream

    hf_layout = not getattr(sink, "native_layout", False)
    await asyncio.to_thread(hub.announce, "push", version=version, hf_layout=hf_layout)
    stream = iter_hf_tensors(trainer.model(), hf_layout=hf_layout)
    host = await asyncio.to_thread(list, stream)
    return HFTensorStream(iter(host), stream.layout, hf_layout=stream.hf_layout)


async def push_weights(cfg: RunConfig, trainer: Any, sink: Any, version: int, iter_hf_tensors: Any,
                       hub: Any = None, lent: Any = None, hold: bool = False, tensors: Any = None) -> None:
    """Push the trainer's params, or ``lent`` (from ``lend_params``: params that outlive the next
    update, for a push that overlaps it), or ``tensors`` already gathered (``gather_push``), as
    ``version``; ``hold``: the servers serve it only at ``sink.commit(version)``."""
    if cfg.rollout.backend == "local":  # device to device; shared: the engine keeps the trainer's arrays
        shared = cfg.rollout.local.placement == "shared"
        await sink.push_params(version, lent if lent is not None else
                               trainer.lend_params() if shared else trainer.params)
        return
    if tensors is not None:  # gathered already: only the sending is left
        await (sink.push(version, tensors, hold=True) if hold else sink.push(version, tensors))
        return
    hf_layout = not getattr(sink, "native_layout", False)  # our own servers over HTTP take our kernels untransposed
    if hub is not None:
        await asyncio.to_thread(hub.announce, "push", version=version, hf_layout=hf_layout)
    tensors = iter_hf_tensors(trainer.model(lent), hf_layout=hf_layout)
    try:
        await (sink.push(version, tensors, hold=True) if hold else sink.push(version, tensors))
    finally:
        if hub is not None and hub.processes > 1:
            # The other processes gather every tensor with this one (collectives): a push that
            # stopped early (every server refused it) still has to finish the gathers.
            await asyncio.to_thread(collections.deque, tensors, 0)


def follow(hub: Any, trainer: Any, ckpts: Any) -> None:
    """A follower's part of a multi-process run (process 1 and up): the collective work process
    0 announces, step by step, until it stops the run."""
    import jax

    from areal_jax.models import iter_hf_tensors

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
            elif op == "push":  # take part in the gathers; process 0 sends the tensors
                collections.deque(iter_hf_tensors(trainer.model(), owned=lambda name: False,
                                                  hf_layout=message.get("hf_layout", True)), 0)
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


async def run_steps(cfg: RunConfig, trainer: Any, controller: RolloutController, client: Any, sink: Any,
                    episode_client: EpisodeClient, data: Any, logger: MetricsLogger, fleet: Any, t_start: float,
                    iter_hf_tensors: Any, *, start: int = 0, ckpts: Any = None,
                    on_step: Callable[[dict[str, Any]], None] | None = None, hub: Any = None,
                    files: Any = None) -> None:
    """Steps ``start + 1 .. cfg.steps`` of a run (process 0), each logged through ``logger``;
    ``files`` (a ``RunDir``): a URL run directory gets the metrics after every checkpoint."""
    rollout = cfg.rollout
    version = controller.version
    gen_tokens = controller.counters.generated_tokens
    t_last = time.perf_counter()
    save_s = None
    # Async mode: the push of a version runs while the next batch trains (overlap_weight_push).
    overlap = rollout.mode == "async" and rollout.overlap_weight_push
    pushing: asyncio.Task | None = None
    try:
        for step in range(start + 1, cfg.steps + 1):
            if fleet is not None:
                fleet.check()
            t0 = time.perf_counter()
            groups = await batch_or_dead_server(controller, fleet)
            wait_s = time.perf_counter() - t0
            trajectories = flatten_groups(groups)
            staleness = [t.staleness(version) for t in trajectories]
            t1 = time.perf_counter()
            if hub is not None:
                await asyncio.to_thread(hub.announce, "train", step=step, version=version, trajectories=trajectories,
                                        prompt_ids=[g.row_id for g in groups])
            stats = await asyncio.to_thread(trainer.train_batch, trajectories, version)
            train_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            skipped = int(stats.get("skipped_steps", 0))
            if skipped >= cfg.algo.ppo_n_minibatches:
                # Every update of this batch had a NaN/inf and was skipped: the weights are the ones
                # rollout already serves, so there is no new version to push.
                logger.write(f"step {step}: every optimizer step had a non-finite loss or gradient and was "
                             f"skipped; weights unchanged, version stays {version}, nothing pushed")
            else:
                version += 1
                if pushing is not None:  # one push at a time, in version order; raises what it raised
                    await pushing
                    pushing = None
                if overlap:
                    pushing = await start_push(cfg, client, sink, trainer, version, iter_hf_tensors, controller, step,
                                               hub)
                else:
                    await push(cfg, client, sink, trainer, version, iter_hf_tensors, controller, hub)
            sync_s = time.perf_counter() - t2
            controller.set_version(version, step)
            now = time.perf_counter()
            counters = controller.counters
            metrics: dict[str, Any] = {
                "step": step, "version": version, "time": now - t_start,
                # The trainer's wait for a full batch (rollout runs throughout, so in async mode
                # this is not generation time), then its update, then the weight push.
                "batch_wait_seconds": wait_s, "train_seconds": train_s, "weight_sync_seconds": sync_s,
                "compile_seconds": float(stats.get("compile_seconds", 0.0)),
                "reward_mean": float(np.mean([t.reward for t in trajectories])),
                "staleness_max": int(max(staleness)), "staleness_mean": float(np.mean(staleness)),
                # Tokens generated since the last step over the wall time since then: the rate
                # rollout keeps up across the run, not one engine's decode speed.
                "gen_tokens_per_wall_s": (counters.generated_tokens - gen_tokens) / max(now - t_last, 1e-9),
                "train_tokens_per_s": stats.get("real_tokens", 0.0) / max(train_s, 1e-9),
                "trajectories": len(trajectories),
                "answer_len_mean": float(np.mean([t.answer_len for t in trajectories])),
                "answer_len_max": int(max(t.answer_len for t in trajectories)),
                "filtered": counters.filtered, "failed": counters.failed, "stale_dropped": counters.stale_dropped,
                "stale_requeued": counters.stale_requeued, "stale_abandoned": counters.stale_abandoned,
                "reward_failures": episode_client.reward_failures,
                "skipped_steps": skipped, "skipped_steps_total": trainer.skipped_steps,
                "prompt_ids": [g.row_id for g in groups],
                "remat": trainer.policy.remat,
            }
            if trainer.memory is not None:
                metrics.update(trainer.memory.metrics())
            if save_s is not None:
                metrics["checkpoint_seconds"], save_s = save_s, None
            for k in ("loss", "clip_fraction", "dual_clip_fraction", "behavior_imp_weight_mean",
                      "behavior_imp_weight_max", "dropped_fraction", "m2", "m2_dropped_fraction", "behavior_kl",
                      "entropy", "grad_norm", "lr", "kl_ref_mean", "kl_loss", "value_loss"):
                if k in stats and math.isfinite(stats[k]):
                    metrics[k] = float(stats[k])
            gen_tokens, t_last = counters.generated_tokens, now
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.steps:
                if pushing is not None:  # evaluate the version just trained
                    await pushing
                    pushing = None
                metrics.update(await evaluate(episode_client, data.eval_rows, cfg.eval,
                                              max_new_tokens=rollout.max_new_tokens))
            # What the servers hold now: this step's version, or with a push in flight the one before.
            metrics["served_versions"] = await served_versions(client)
            metrics["step_seconds"] = time.perf_counter() - t0  # the whole step, its evaluation included
            logger.log(metrics)
            if ckpts is not None and ckpts.due(step, last=step == cfg.steps):
                from areal_jax.trainer.checkpoint import rng_state

                # Taken between awaits: the controller's state matches the trainer's (batches 1..step).
                meta = {"step": step, "total_steps": cfg.steps, "version": version, "trainer_step": trainer.step,
                        "critic_step": trainer.critic_step, "time": now - t_start,
                        "controller": controller.state_dict(), "rng": rng_state()}
                meta = json.loads(json.dumps(meta))  # a copy that later steps cannot change under a background save
                if hub is not None:
                    await asyncio.to_thread(hub.announce, "save", step=step, meta=meta)
                save_s = await asyncio.to_thread(ckpts.save, step, trainer.checkpoint_state(), meta)
                if files is not None and files.remote:  # never behind the checkpoint a resume starts from (log flushed)
                    await asyncio.to_thread(files.publish, "metrics.jsonl", "tensorboard", "logs")
            if on_step is not None:
                on_step(metrics)
        if pushing is not None:
            await pushing
    finally:
        if pushing is not None and not pushing.done():  # the run failed: end the push in flight
            pushing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pushing


async def start_push(cfg: RunConfig, client: Any, sink: Any, trainer: Any, version: int, iter_hf_tensors: Any,
                     controller: RolloutController, step: int, hub: Any = None) -> asyncio.Task:
    """Start pushing ``version`` from lent params (several processes: from tensors gathered now,
    see the module docstring), so the next update may run meanwhile, and return the push's
    task; the controller holds ``version`` from then on.

    A sample's staleness is that of its oldest token, and each token carries the version that
    made it, so the tokens the servers still make under the version before, until their pause
    lands, count as that older version and the bound holds. Only with ``max_staleness`` 0 would
    they make their samples too stale to train: then this returns once the servers have paused,
    and the controller takes the version at that moment."""
    lent = tensors = None
    if multi_process(hub):
        tensors = await gather_push(trainer, sink, version, iter_hf_tensors, hub)
    else:
        lent = trainer.lend_params()
    if cfg.rollout.effective_max_staleness != 0:
        controller.set_version(version, step)
        return asyncio.create_task(push(cfg, client, sink, trainer, version, iter_hf_tensors, controller, lent=lent,
                                        tensors=tensors))
    paused = asyncio.Event()

    def on_paused() -> None:
        controller.set_version(version, step)
        paused.set()

    task = asyncio.create_task(push(cfg, client, sink, trainer, version, iter_hf_tensors, controller, lent=lent,
                                    tensors=tensors, on_paused=on_paused))
    waiting = asyncio.create_task(paused.wait())
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if not paused.is_set():  # the push ended before the pause took: raise what it raised
        waiting.cancel()
        await task
    return task


async def push(cfg: RunConfig, client: Any, sink: Any, trainer: Any, version: int, iter_hf_tensors: Any,
               controller: RolloutController, hub: Any = None, *, lent: Any = None, tensors: Any = None,
               on_paused: Callable[[], None] | None = None) -> None:
    """The new weights to rollout as ``version``; in async mode between a pause (with abort) and
    a continue, so answers in flight resume under them (with ``rollout.interruptible: false``,
    after the episodes in flight have finished instead). With ``rollout.push_before_pause`` and
    a sink that can hold a version (HTTP buckets to our servers), the servers take it while they
    still generate, then each pauses, swaps it in and continues within one call
    (``sink.commit``); the tokens made meanwhile carry the version before. ``lent``: push these
    params, ``tensors``: send these, gathered already (see ``push_weights``); ``on_paused`` is
    called once the servers have paused."""
    from rollout_bridge.client import WeightUpdateError

    rollout = cfg.rollout
    # Not when the caller waits for the pause (``max_staleness`` 0 overlapped): the pause comes
    # first there, so that the next update overlaps the transfer.
    hold = (rollout.mode == "async" and rollout.push_before_pause and getattr(sink, "can_hold", False)
            and on_paused is None)
    try:
        refused: WeightUpdateError | None = None
        if hold:
            try:
                await push_weights(cfg, trainer, sink, version, iter_hf_tensors, hub, lent, hold=True, tensors=tensors)
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
            await push_weights(cfg, trainer, sink, version, iter_hf_tensors, hub, lent, tensors=tensors)
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
