"""One measured RL run: the benchmark task, a warm-started checkpoint made once per invocation,
a rollout server the benchmark starts itself (so it can pin it to CPU cores and watch it), and
the figures of the run.

The task is the demo's one-digit addition with a scratch pad of long-tailed length: the warm
start teaches answers of the form ``"." * k + "\n" + sum`` with ``k`` drawn from a lognormal
(``SCRATCH``: median 6, clipped at 80), and the reward reads the last line (``--long-tail``'s
scratch pad writes the sum out again instead of dots, with a longer tail). The
policy then samples its own scratch lengths, most short and a few long, as reasoning models do,
so a synchronous step waits for its longest answer while most slots sit finished. Held-out
accuracy samples at the policy's temperature (1): greedy decoding on this task writes dots
to the token limit (every scratch position's likeliest next token is another dot).

Figures are taken over the steps after ``warmup_steps`` (the first steps compile): wall-clock
per step, generated tokens/s (the server's counter), trained answer tokens/s, the fraction of
that window the trainer spent waiting for a batch, the fraction the server had no request
running or queued (polled every ``POLL_S``), held-out accuracy before, during and after, and
the run's training clock at each evaluation.
"""

from __future__ import annotations

import contextlib
import copy
import http.client
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
SCRATCH: dict[str, Any] = {"median": 6, "sigma": 1.0, "max": 80, "unit": "."}
"""``TASK``'s warm-start scratch pad: ``unit`` repeated k times, k lognormal (median, sigma of its
log), clipped at max."""
LONG_TAIL_SCRATCH: dict[str, Any] = {"median": 2, "sigma": 1.5, "max": 50, "unit": "echo"}
"""``LONG_TAIL_TASK``'s: the sum itself written out again k times (``"3+5;"``), so the answer
reads its operands from the line just before it and not across hundreds of dots (a warm start
on dots that long reached 5% and RL did not move it)."""

TASK: dict[str, Any] = {
    "batch_size": 8,
    "data": {"source": "reasoning_gym", "task": "basic_arithmetic", "size": 4000, "seed": 0, "eval_size": 100,
             "task_options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                              "allow_parentheses": False, "allow_negation": False}},
    "model": {"tiny": "tiny", "tiny_options": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}},
    "reward": {"name": "reasoning_gym", "num_workers": 1},
    "warm_start": {"steps": 400, "batch_size": 64, "lr": 0.003, "max_len": 128},
    # DAPO's dynamic sampling, as AReaL's reasoning recipes run it: a group whose answers all score
    # the same teaches GRPO nothing and is dropped, so rollout generates more than is trained.
    "rollout": {"group_size": 8, "max_new_tokens": 96, "temperature": 1.0, "filter_uniform_reward": True,
                "server_args": ["--max-running-requests", "128", "--context-length", "160", "--server-warmup"]},
    "algo": {"adv_estimator": "grpo"},
    "train": {"lr": 0.0003, "micro_batch_tokens": 2048, "length_buckets": [2048], "max_seq_len": 160},
    "eval": {"every": 10, "temperature": 1.0},
    "export": False,
}
"""The async and interrupt parts' run config (a dict in ``RunConfig``'s shape) before
``model.path`` is set: the scratch-pad task (long-tailed answers), warm-started to about 16%.
Its server compiles every step shape before the run (``--server-warmup``), as a long run's
servers have compiled them by its steady state: compiled on first use instead, a new shape
stalled a weight update's pause for about 1.2 s on the rollout core, several times a run."""

LONG_TAIL_TASK: dict[str, Any] = {
    **TASK,
    "data": {**TASK["data"], "eval_size": 400},
    "warm_start": {**TASK["warm_start"], "max_len": 300},
    "rollout": {**TASK["rollout"], "max_new_tokens": 448,
                "server_args": ["--max-running-requests", "128", "--context-length", "512", "--server-warmup"]},
    "algo": {**TASK["algo"], "ppo_n_minibatches": 2},
    "train": {**TASK["train"], "max_seq_len": 512, "lr": 1e-4, "compile_warmup": True,
              "micro_batch_tokens": 512, "length_buckets": [256, 384, 512]},
}
"""``areal-jax bench --long-tail``: the regime of AReaL's long reasoning answers, where generation
is most of a synchronous step. The echoed scratch pad (``LONG_TAIL_SCRATCH``) under RL grows a
tail to the 448-token limit against a mean near 100, so a synchronous step waits on a few long
answers decoding at low concurrency. Two optimizer steps per batch, as ``RunConfig.advisories``
asks of decoupled PPO at ``max_staleness`` 4. Warm-started to about 20% (temperature 1); 400
held-out prompts, so that a few points of learning stand out of the noise. Learning rate 1e-4, a
third of ``TASK``'s: at 3e-4 synchronous RL stalled near 34% after 10 steps and each policy
version moved the trained tokens' KL by 0.015-0.08, far from the small steps of RL on real
models; at 1e-4 both synchronous and asynchronous runs end about 9-12 points higher. The trainer
compiles its step shapes before the first step (``train.compile_warmup``), as the server does:
otherwise a fresh trainer process compiled 0.04 s a step, on average, inside the timed steps of a
30-step run, as the answers grew into new attention pair budgets. Rows of 512 tokens (the longest
trajectory), padded to 256, 384 or 512: a minibatch of about 1,650 tokens trains as three or four
short rows, not one row of 2,048, and replayed on one core the bench's own batches trained in
0.104 s a step against 0.173 s (2026-11-27, docs/results.md)."""

DEMO_TASK: dict[str, Any] = {
    "batch_size": 16,
    "data": {**TASK["data"], "eval_size": 200},
    "model": TASK["model"],
    "reward": {"name": "reasoning_gym", "num_workers": 1},
    "warm_start": {"steps": 190, "batch_size": 64, "lr": 0.003, "max_len": 40},
    "rollout": {"group_size": 8, "max_new_tokens": 8, "temperature": 1.0,
                "server_args": ["--max-running-requests", "128", "--context-length", "128"]},
    "algo": {"adv_estimator": "grpo"},
    "train": {"lr": 0.0003, "micro_batch_tokens": 4096, "length_buckets": [4096], "max_seq_len": 128},
    "eval": {"every": 0},
    "export": False,
}
"""The staleness ablation's run config: ``configs/demo.yaml``'s task (one-digit sums answered at
once, greedy held-out accuracy), which RL moves from about 40% to 80% in 100 steps: enough
learning in a short run for staleness to show in it."""


STEPS = 30
"""RL steps per run of the async and interrupt parts (``--steps`` sets another count)."""


def warmup_steps(quick: bool) -> int:
    """Steps at the start of each async or interrupt run that compile and are left out of its figures."""
    return 1 if quick else 3


def run_steps(quick: bool, steps: int | None = None) -> tuple[int, int]:
    """``(steps, warm-up steps)`` of each async or interrupt run: ``steps`` when given, else
    ``STEPS`` (4 with ``quick``)."""
    return steps or (4 if quick else STEPS), warmup_steps(quick)


def task_config(quick: bool, task: dict[str, Any] | None = None) -> dict[str, Any]:
    """``task`` (default ``TASK``), smaller with ``quick`` (shorter warm start, fewer held-out
    prompts, smaller batches)."""
    cfg = copy.deepcopy(TASK if task is None else task)
    if quick:
        cfg["warm_start"].update(steps=10, batch_size=16)
        cfg["data"].update(size=300, eval_size=16)
        cfg["rollout"].update(group_size=4, max_new_tokens=min(32, cfg["rollout"]["max_new_tokens"]),
                              filter_uniform_reward=False)
        cfg["eval"]["every"] = 0
        cfg["batch_size"] = 2
        # Few steps, none of them timed closely: compiling every server shape would be most of it.
        cfg["rollout"]["server_args"] = [a for a in cfg["rollout"]["server_args"] if a != "--server-warmup"]
    return cfg


def scratch_examples(rows: list[Any], tokenizer: Any, seed: int,
                     scratch: dict[str, Any] = SCRATCH) -> list[tuple[list[int], list[int]]]:
    """Warm-start pairs ``(prompt_ids, unit * k + "\n" + answer + eos)``, ``k`` drawn as
    ``scratch`` says; the unit ``"echo"`` is the row's expression without spaces and a ``;``."""
    from areal_jax.trainer.sft import reference_answer

    rng = np.random.default_rng(seed)
    ks = np.minimum(rng.lognormal(np.log(scratch["median"]), scratch["sigma"], len(rows)).astype(int), scratch["max"])
    out = []
    for r, k in zip(rows, ks, strict=True):
        text = _unit(r, scratch.get("unit", ".")) * int(k) + "\n" + reference_answer(r)
        out.append((list(r.prompt_ids), [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]))
    return out


def _unit(row: Any, unit: str) -> str:
    if unit != "echo":
        return unit
    try:
        return str(row.reward_fields["entry"]["metadata"]["expression"]).replace(" ", "") + ";"
    except KeyError as e:
        raise ValueError(f"row {row.id}: an echoed scratch pad needs a reasoning-gym entry with "
                         "metadata.expression (basic_arithmetic's rows have it)") from e


def warm_checkpoint(cfg: dict[str, Any], out_dir: Path, *, scratch: dict[str, Any] | None = SCRATCH) -> Path:
    """Build the tiny model, run the warm start once (on ``scratch_examples`` drawn as ``scratch``
    says, or with ``scratch`` None on the task's own reference answers) and save it; every run of
    the invocation that uses ``cfg`` starts from this directory (``<out_dir>/warm_start``, reused when present)."""
    from areal_jax.config import from_dict
    from areal_jax.data import load_prompts
    from areal_jax.models import load_pretrained, load_tokenizer, save_pretrained
    from areal_jax.trainer.rl import prepare_model_dir
    from areal_jax.trainer.run_config import RunConfig
    from areal_jax.trainer.sft import warm_start

    target = out_dir / "warm_start"
    if (target / "config.json").exists():
        return target
    run = from_dict(RunConfig, {**cfg, "run_dir": str(out_dir)})
    base = prepare_model_dir(run, out_dir)
    tokenizer = load_tokenizer(base)
    model = load_pretrained(base)
    rows = load_prompts(run.data, tokenizer).train_rows
    examples = None
    if scratch is not None:
        examples = [e for e in scratch_examples(rows, tokenizer, run.seed, scratch)
                    if len(e[0]) + len(e[1]) <= run.warm_start.max_len]
    warm_start(model, run.warm_start, tokenizer, rows, examples=examples)
    return Path(save_pretrained(model, target, tokenizer_dir=base))


SHIPPED_WARM_STARTS = Path(__file__).parent / "warm_starts"
"""Warm starts that ship with the package, one folder each (a HF checkpoint and a README saying
how it was made)."""


def shipped_warm_start(name: str, out_dir: Path) -> Path:
    """Copy the shipped warm start ``name`` (``SHIPPED_WARM_STARTS / name``) to
    ``<out_dir>/warm_start`` and return that path; a copy already there is checked and reused.

    Why ship one: a warm start at a constant learning rate ends wherever its last batches put it,
    so the same 400 steps land elsewhere when rounding changes. Rebuilt with the decoder as it
    computes since 2026-11-25 (the same maths, another summation order), the long-tail warm start
    evaluated 10.5-10.8% instead of 21.75%, and 30 RL steps moved it 0-4 points instead of about 20.
    Benchmarks compare runs from one fixed checkpoint, as RL papers start from one released model."""
    import filecmp
    import shutil

    source = SHIPPED_WARM_STARTS / name
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"no shipped warm start {name!r} in {SHIPPED_WARM_STARTS}")
    target = out_dir / "warm_start"
    files = sorted(p.name for p in source.iterdir() if p.is_file() and p.name != "README.md")
    if target.exists():
        _, differ, missing = filecmp.cmpfiles(source, target, files, shallow=False)
        if differ or missing:
            raise FileExistsError(f"{target} holds another checkpoint ({differ + missing} differ from the shipped "
                                  f"{name!r}): give a new --out, or --warm-start build to train one")
        return target
    target.mkdir(parents=True)
    for f in files:
        shutil.copyfile(source / f, target / f)
    return target


def run_config(task: dict[str, Any], checkpoint: Path, run_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A run of ``task`` from ``checkpoint``; ``overrides`` are dotted keys (``rollout.mode``), and
    a key ending in ``+`` extends the list there (``rollout.server_args+``)."""
    cfg = copy.deepcopy(task)
    cfg.pop("warm_start", None)
    cfg["model"] = {"path": str(checkpoint)}
    cfg["run_dir"] = str(run_dir)
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if leaf.endswith("+"):
            node[leaf[:-1]] = [*node.get(leaf[:-1], []), *value]
        else:
            node[leaf] = value
    return cfg


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
                                         vals.get("areal_jax:prefill_seconds_total", math.nan),
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
                 warmup_steps: int, own_process: bool = False) -> dict[str, Any]:
    """Start one rollout server (on ``rollout_cores``; None: all), train ``cfg`` against it on
    ``trainer_cores`` (None: all), and return the run's figures.

    ``own_process``: the trainer is a new process started on ``trainer_cores``, as a deployed
    trainer is, so XLA sizes its thread pool to them. This process sized its pool for every core;
    pinned to one core afterwards, its two pool threads made a warm training step 4-7% slower
    (a replay of the long-tail trainer's steps, 2026-11-26)."""
    if own_process:
        return run_pinned(trainer_cores or all_cores(), measured_run, cfg, rollout_cores=rollout_cores,
                          trainer_cores=trainer_cores, warmup_steps=warmup_steps)
    from areal_jax.trainer.rl import train
    from rollout_bridge.launcher import ServerFleet

    run_dir = Path(cfg["run_dir"])
    rollout = cfg.setdefault("rollout", {})
    everything = all_cores()
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
        fleet.stop()
    return summarize(result.metrics, ends, poller, warmup_steps, result.eval_before, result.eval_after,
                     rollout_cores=rollout_cores, trainer_cores=trainer_cores)


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
    waiting = sum(m["rollout_seconds"] for m in timed)
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
