"""One measured RL run: a rollout server the benchmark starts itself (so it can pin it to CPU
cores and watch it), the trainer beside it, and the figures of the run. The tasks and their
warm starts are ``tasks``.

Figures are taken over the steps after ``warmup_steps`` (the first steps compile): wall-clock
per step, generated tokens/s (the server's counter), trained answer tokens/s, the fraction of
that window the trainer spent waiting for a batch, the fraction the server had no request
running or queued (polled every ``POLL_S``), held-out accuracy before, during and after, and
the run's training clock at each evaluation.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import http.client
import json
import math
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

POLL_S = 0.1
"""Seconds between two polls of the server's ``/metrics``, over one kept-alive connection. A poll
costs the server's core about 0.5 ms and the polling thread, on the trainer's core, about as much:
at 0.02 s that was 2.4% of the rollout core and 2.2% of the trainer's, the two cores that bound an
asynchronous run, so the instrument slowed what it measured. At 0.1 s each pays about 0.5%, and a
30-step run still gets over a hundred samples of the rollout's idle fraction."""
def all_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def pin_process(cores: list[int], pid: int | None = None) -> None:
    """Pin every thread of a process (this one by default) to ``cores``; threads started later
    inherit the affinity of the thread that starts them."""
    root = f"/proc/{pid or 'self'}/task"
    for tid in os.listdir(root):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


@contextlib.contextmanager
def thread_affinity(cores: list[int]) -> Iterator[None]:
    """Run the block (and the processes it starts) on ``cores``; the calling thread's affinity
    is restored afterwards."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def metric_values(text: str) -> dict[str, float]:
    """A server's ``/metrics`` text (Prometheus format) as ``{metric name: value}``, labels dropped."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+?)\{.*\} (\S+)$", text, re.M)}


class ServerPoller:
    """Polls a server's ``/metrics`` in a thread: ``(time, requests running + queued, generated
    tokens so far, seconds in prefill calls so far, seconds in decode calls so far, seconds paused
    so far)`` every ``POLL_S`` seconds (the last three NaN from a server that does not count them,
    stock SGLang's)."""

    def __init__(self, address: str):
        self.address = address
        self.samples: list[tuple[float, int, float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-poller", daemon=True)

    def _run(self) -> None:
        host, port = self.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=2.0)
        try:
            while not self._stop.is_set():
                try:
                    conn.request("GET", "/metrics")
                    text = conn.getresponse().read().decode()
                    vals = metric_values(text)
                    busy = int(vals["sglang:num_running_reqs"] + vals["sglang:num_queue_reqs"])
                    self.samples.append((time.perf_counter(), busy, vals["sglang:generation_tokens_total"],
                                         # a paged mixed call prefills a chunk (and decodes beside it)
                                         vals.get("areal_jax:prefill_seconds_total", math.nan)
                                         + vals.get("areal_jax:mixed_seconds_total", 0.0),
                                         vals.get("areal_jax:decode_seconds_total", math.nan),
                                         vals.get("areal_jax:paused_seconds_total", math.nan)))
                except (OSError, http.client.HTTPException, KeyError, ValueError):
                    conn.close()  # the next request opens a new connection
                self._stop.wait(POLL_S)
        finally:
            conn.close()

    def __enter__(self) -> ServerPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """``(fraction of samples in [t0, t1] with nothing running or queued, tokens generated
        between t0 and t1)``, the token counter read at t0 and t1 by linear interpolation between
        the samples around them (a poll every ``POLL_S`` would otherwise cut up to one interval off
        each end)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside or len(self.samples) < 2:
            return float("nan"), float("nan")
        idle = sum(1 for s in inside if s[1] == 0) / len(inside)
        return idle, self._delta(2, t0, t1)

    def _delta(self, field: int, t0: float, t1: float) -> float:
        """How much counter ``field`` of the samples grew from t0 to t1, each end read by linear
        interpolation between the samples around it."""
        times, values = [s[0] for s in self.samples], [s[field] for s in self.samples]
        return float(np.interp(t1, times, values) - np.interp(t0, times, values))

    def prefill_share(self, t0: float, t1: float) -> float:
        """Of the server's seconds in compiled prefill and decode calls between t0 and t1, the
        share in prefill (the prompts, and the prefixes that requests resumed after a weight
        update's pause compute again); NaN where the server does not count them."""
        if len(self.samples) < 2:
            return float("nan")
        p, d = self._delta(3, t0, t1), self._delta(4, t0, t1)
        return p / (p + d) if p + d > 0 else float("nan")

    def paused_share(self, t0: float, t1: float) -> float:
        """The share of [t0, t1] the server spent paused (weight updates); NaN where the server
        does not count it."""
        if len(self.samples) < 2 or t1 <= t0:
            return float("nan")
        return self._delta(5, t0, t1) / (t1 - t0)


def run_pinned(cores: list[int], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a new process started on ``cores`` (spawned, so it imports
    JAX afresh): its return value, or its exception raised here."""
    import concurrent.futures
    import multiprocessing

    with thread_affinity(cores), concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


def measured_run(cfg: dict[str, Any], *, rollout_cores: list[int] | None, trainer_cores: list[int] | None,
                 warmup_steps: int, own_process: bool = False, done: dict[str, dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """Start one rollout server (on ``rollout_cores``; None: all), train ``cfg`` against it on
    ``trainer_cores`` (None: all), and return the run's figures.

    ``own_process``: the trainer is a new process started on ``trainer_cores``, as a deployed
    trainer is, so XLA sizes its thread pool to them. This process sized its pool for every core;
    pinned to one core afterwards, its two pool threads made a warm training step 4-7% slower
    (a replay of the long-tail trainer's steps, 2026-11-26).

    ``done``: the runs made so far in this invocation, by ``run_key``. A run whose config (its
    folder aside), cores and warm-up match one there is not made again: its figures are returned,
    with ``same_run_as`` naming that run's folder (the interrupt part's interruptible run is the
    async part's ``async_eta4`` run)."""
    key = run_key(cfg, rollout_cores=rollout_cores, trainer_cores=trainer_cores, warmup_steps=warmup_steps,
                  own_process=own_process)
    if done is not None and key in done:
        return copy.deepcopy(done[key])
    row = _measured_run(cfg, rollout_cores=rollout_cores, trainer_cores=trainer_cores, warmup_steps=warmup_steps,
                        own_process=own_process)
    if done is not None:
        done[key] = {**copy.deepcopy(row), "same_run_as": str(cfg["run_dir"])}
    return row


def run_key(cfg: dict[str, Any], **how: Any) -> str:
    """What makes two measured runs the same run: the config as loaded (a key set to its default
    is the default), its folder aside, and ``how`` it ran."""
    from areal_jax.config import from_dict
    from areal_jax.trainer.run_config import RunConfig

    loaded = dataclasses.asdict(from_dict(RunConfig, {k: v for k, v in cfg.items() if k != "run_dir"}))
    return json.dumps({"config": loaded, **how}, sort_keys=True, default=str)


def _measured_run(cfg: dict[str, Any], *, rollout_cores: list[int] | None, trainer_cores: list[int] | None,
                  warmup_steps: int, own_process: bool = False) -> dict[str, Any]:
    if own_process:
        return run_pinned(trainer_cores or all_cores(), _measured_run, cfg, rollout_cores=rollout_cores,
                          trainer_cores=trainer_cores, warmup_steps=warmup_steps)
    from areal_jax.trainer.rl import train
    from rollout_bridge.launcher import ServerFleet

    run_dir = Path(cfg["run_dir"])
    rollout = cfg.setdefault("rollout", {})
    everything = all_cores()
    shared, fleet = _SHARED.get(), None
    if shared is not None:
        addresses = [shared.address(cfg, rollout_cores or everything)]
    else:
        with thread_affinity(rollout_cores or everything):
            fleet = ServerFleet(cfg["model"]["path"], 1, run_dir / "logs", extra_args=rollout.get("server_args", []),
                                seed=cfg.get("seed", 0))
            addresses = fleet.start()
    ends: list[float] = []
    offset: list[float] = []

    def on_step(m: dict[str, Any]) -> None:
        if not offset:  # the first step ends without an evaluation: this fixes train's clock
            offset.append(time.perf_counter() - m["time"])
        ends.append(offset[0] + m["time"])

    try:
        pin_process(trainer_cores or everything)
        with ServerPoller(addresses[0]) as poller:
            result = train({**cfg, "rollout": {**rollout, "backend": "servers", "servers": addresses}},
                           on_step=on_step)
    finally:
        pin_process(everything)
        if fleet is not None:
            fleet.stop()
    return summarize(result.metrics, ends, poller, warmup_steps, result.eval_before, result.eval_after,
                     rollout_cores=rollout_cores, trainer_cores=trainer_cores)


class SharedServers:
    """Rollout servers kept across the measured runs of one invocation (``--quick``, whose figures
    are a smoke test): a run whose server would start on the same checkpoint, server arguments,
    seed and cores as an earlier run's takes that server, its weights first loaded again from the
    checkpoint (``/update_weights_from_disk``, as version ``default``, the label a new server
    starts with) and any pause lifted. Starting a server (a process importing JAX, loading the
    model and its compiled programs) cost more CPU time than a quick run's three steps
    (2026-11-28: about 6.5 CPU-seconds of each quick run's 10). What a reused server does not
    start afresh is its sampling random stream (requests without a ``sampling_seed`` draw from
    it) and the programs it compiled: a full run never reuses one, so its figures are of a
    server started for it alone."""

    def __init__(self) -> None:
        self._fleets: dict[str, tuple[Any, Path]] = {}

    def address(self, cfg: dict[str, Any], cores: list[int]) -> str:
        """The address of the server for ``cfg``'s run on ``cores``: one started now (its log in
        the run's ``logs/``), or an earlier run's, reset (the run's ``logs/server-0.log`` then
        names that run's log)."""
        from rollout_bridge.launcher import ServerFleet

        model, run_dir = Path(cfg["model"]["path"]), Path(cfg["run_dir"])
        server_args, seed = list(cfg["rollout"].get("server_args", [])), cfg.get("seed", 0)
        key = json.dumps([str(model.absolute()), server_args, seed, sorted(cores)])
        if key not in self._fleets:
            with thread_affinity(cores):
                # weights pushed through the disk go under any run's folder, not only this one's
                fleet = ServerFleet(model, 1, run_dir / "logs", extra_args=server_args, seed=seed,
                                    weight_roots=[model.absolute().parent, run_dir.absolute().parent])
                fleet.start()
            self._fleets[key] = (fleet, run_dir)
            return fleet.addresses[0]
        fleet, first = self._fleets[key]
        fleet.check(restart=False)  # one that died is an error, not a new server
        address = fleet.addresses[0]
        _post_json(address, "/update_weights_from_disk", {"model_path": str(model.absolute()),
                                                          "weight_version": "default", "flush_cache": True})
        _post_json(address, "/continue_generation", {})
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "logs" / "server-0.log").write_text(
            f"this run used the server of {first} (same checkpoint, arguments, seed and cores), its weights "
            f"loaded again from {model}: {first / 'logs' / 'server-0.log'}\n")
        return address

    def close(self) -> None:
        for fleet, _ in self._fleets.values():
            fleet.stop()
        self._fleets.clear()


_SHARED: contextvars.ContextVar[SharedServers | None] = contextvars.ContextVar("bench_shared_servers", default=None)


@contextlib.contextmanager
def shared_servers() -> Iterator[SharedServers]:
    """Inside the block, ``measured_run`` takes its servers from one ``SharedServers`` (stopped
    at the end of the block)."""
    servers = SharedServers()
    token = _SHARED.set(servers)
    try:
        yield servers
    finally:
        _SHARED.reset(token)
        servers.close()


def _post_json(address: str, path: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        reply = json.loads(resp.read() or b"{}")
    finally:
        conn.close()
    if resp.status != 200 or reply.get("success") is False:
        raise RuntimeError(f"{address}{path} answered {resp.status}: {reply}")
    return reply


def summarize(metrics: list[dict[str, Any]], ends: list[float], poller: ServerPoller, warmup_steps: int,
              eval_before: dict[str, Any] | None, eval_after: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    """The figures of one run over the steps after ``warmup_steps``."""
    n = len(metrics)
    k = min(warmup_steps, n - 1)
    t0, t1 = ends[k - 1] if k > 0 else ends[0] - metrics[0]["time"], ends[-1]
    timed = metrics[k:]
    rollout_idle, generated = poller.window(t0, t1)
    # A step's "time" is taken before its own held-out evaluation, so the window holds the
    # evaluations of steps k .. n-1 (not the last step's): their seconds are not training's.
    wall = t1 - t0 - sum(m.get("eval_seconds", 0.0) for m in metrics[max(k - 1, 0):n - 1])
    trained = sum(m["trajectories"] * m["answer_len_mean"] for m in timed)
    waiting = sum(m["batch_wait_seconds"] for m in timed)
    per_step = wall / len(timed)
    # Seconds the trainer spent compiling a shape it met for the first time (a longer answer
    # needing a larger attention pair budget, say): a one-off that a long run pays once, but that
    # falls at random in a short one, so the steady rate leaves it out.
    compiling = sum(m.get("compile_seconds", 0.0) for m in timed)
    return {
        **extra,
        "steps": n, "timed_steps": len(timed),
        "wall_s_per_step": wall / len(timed),
        "compile_s_per_step": compiling / len(timed),
        "steady_s_per_step": (wall - compiling) / len(timed),
        "generated_tokens_per_s": generated / wall,
        "trained_tokens_per_s": trained / wall,
        "trainer_idle_fraction": min(1.0, waiting / wall),
        "rollout_idle_fraction": rollout_idle,
        "rollout_prefill_share": poller.prefill_share(t0, t1),
        "rollout_paused_share": poller.paused_share(t0, t1),
        "train_s_per_step": float(np.mean([m["train_seconds"] for m in timed])),
        "weight_sync_s_per_step": float(np.mean([m["weight_sync_seconds"] for m in timed])),
        "staleness_mean": float(np.mean([m["staleness_mean"] for m in timed])),
        "answer_len_mean": float(np.mean([m["answer_len_mean"] for m in timed])),
        "answer_len_max": int(max(m["answer_len_max"] for m in timed)),
        "accuracy_before": (eval_before or {}).get("eval_accuracy"),
        "accuracy_after": (eval_after or {}).get("eval_accuracy"),
        "reward_curve": [m["reward_mean"] for m in metrics],
        "step_end_s": [e - (ends[0] - metrics[0]["time"]) for e in ends],
        "accuracy_curve": [[0, (eval_before or {}).get("eval_accuracy")]] + [
            [m["step"], m["eval_accuracy"]] for m in metrics if m.get("eval_accuracy") is not None],
        "accuracy_clock": accuracy_clock(metrics, ends, k, t0, per_step, eval_before),
        "eval_prompts": (eval_after or eval_before or {}).get("eval_prompts"),
        "filtered_fraction": metrics[-1]["filtered"] / max(1, metrics[-1]["filtered"] + len(metrics) * len(
            metrics[-1]["prompt_ids"])),
    }


def accuracy_clock(metrics: list[dict[str, Any]], ends: list[float], warmup_steps: int, t0: float, per_step: float,
                   eval_before: dict[str, Any] | None) -> list[list[float]]:
    """``[training seconds, held-out accuracy]`` at each evaluation: the run's clock with the
    evaluations' own seconds taken out, and the ``warmup_steps`` first steps (which compile)
    charged at the steady ``per_step`` rate, so runs that hit a warm compile cache and runs that
    did not are on one clock."""
    out = [[0.0, (eval_before or {}).get("eval_accuracy")]]
    evals = 0.0  # seconds of the evaluations between t0 and the end of step i (steps warmup .. i - 1)
    for i, m in enumerate(metrics):
        step = i + 1
        if m.get("eval_accuracy") is not None:
            clock = step * per_step if step <= warmup_steps else warmup_steps * per_step + ends[i] - t0 - evals
            out.append([clock, m["eval_accuracy"]])
        if step >= warmup_steps:
            evals += m.get("eval_seconds", 0.0)
    return out


def seconds_to(clock: list[list[float]], target: float) -> float | None:
    """The training seconds at the first evaluation that reached ``target`` accuracy (None: none did)."""
    return next((t for t, acc in clock if acc is not None and acc >= target), None)
