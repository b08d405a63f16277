"""Asynchronous RL against synchronous: the same config, seed, checkpoint and number of steps,
run synchronously and then asynchronously at each ``max_staleness``, one after another in one
process so machine drift hits them alike; the whole set at ``SEEDS`` RL seeds.

Asynchronous runs split the cores the way a deployment would: the rollout server on the last
core(s), the trainer on the others, in a process of its own started there (but with ``--quick``,
whose figures are a smoke test). The synchronous baseline gets every core for each phase
(generation, then training), since only one of them runs at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_jax.bench import report, runs, tasks

SEEDS = 3
"""RL seeds per mode in a full run: one run's answer lengths, and so its step time, drift with its
own policy, and its final accuracy moves by more than the held-out error from seed to seed."""


ON_REQUEST: list[tuple[str, str, int, dict[str, Any]]] = [
    ("async_eta4_naive", "async", 4, {"algo.use_decoupled_loss": False}),
    ("async_eta4_m2po", "async", 4, {"algo.m2_threshold": 0.04}),
    ("async_eta4_push_inline", "async", 4, {"rollout.overlap_weight_push": False}),
    ("async_eta4_retract", "async", 4, {"rollout.pause_mode": "retract"}),
    ("async_eta4_unshared", "async", 4, {"rollout.server_args+": ["--disable-radix-cache"]}),
    ("async_eta4_pause_first", "async", 4, {"rollout.push_before_pause": False}),
    ("async_eta4_per_answer", "async", 4, {"rollout.batch_group_requests": False}),
]
"""Modes run only when ``--modes`` names them, both at ``max_staleness`` 4:

- ``async_eta4_naive``: naive PPO (the clipped ratio against the behaviour policy, AReaL's
  ablation), whose clip bounds how far each update moves from the policy that sampled the
  tokens. At ``max_staleness`` 0 it is the synchronous run's own computation, so the baseline
  serves both.
- ``async_eta4_m2po``: decoupled PPO with M2PO's trust region against the behaviour policy
  (``algo.m2_threshold`` 0.04, its value in AReaL's M2PO recipe). At ``max_staleness`` 0 it
  can touch only the second minibatch, one update away from the sampler, so the plain
  synchronous run is its baseline too.
- ``async_eta4_push_inline``: each weight push before the next batch trains, as before
  ``rollout.overlap_weight_push`` (which the plain asynchronous modes use): what the overlap buys.
- ``async_eta4_retract``: servers pause with ``retract``: the answers in flight go back to the
  server's queue and are prefilled again under the new weights there, instead of returning to
  the client to be sent again (abort). The KV is recomputed either way.
- ``async_eta4_pause_first``: each push pauses the servers first and sends the weights while
  they wait, as before ``rollout.push_before_pause``: what sending them beforehand buys.
- ``async_eta4_per_answer``: one /generate per answer, as before ``rollout.batch_group_requests``."""


def modes(quick: bool, only: list[str] | None = None) -> list[tuple[str, str, int, dict[str, Any]]]:
    """``(name, mode, max_staleness, other overrides)``, the synchronous baseline first.

    The asynchronous runs pause with abort and recompute the KV of the answers in flight after
    each weight update (AReaL's interruptible rollout, the default); a full run adds
    ``max_staleness`` 4 paused ``in_place`` (the answers go on over their stale KV, as PipelineRL
    does), which spares the rollout core those recomputes. ``only``: the names to run, of these
    and ``ON_REQUEST`` (the baseline runs whatever it says: every ratio is to it)."""
    out: list[tuple[str, str, int, dict[str, Any]]] = [("sync", "sync", 0, {})]
    out += [(f"async_eta{eta}", "async", eta, {}) for eta in ((4,) if quick else (1, 2, 4))]
    if not quick:
        out.append(("async_eta4_in_place", "async", 4, {"rollout.pause_mode": "in_place"}))
    if only is None:
        return out
    known = out + ON_REQUEST
    unknown = sorted(set(only) - {m[0] for m in known})
    if unknown:
        raise ValueError(f"--modes: unknown mode(s) {unknown}; choose from {[m[0] for m in known[1:]]}"
                         + (" (--quick runs fewer)" if quick else ""))
    return [m for m in known if m[0] == "sync" or m[0] in only]


def split_cores() -> tuple[list[int], list[int]]:
    """``(rollout cores, trainer cores)``: half each, rollout on the upper half."""
    cores = runs.all_cores()
    if len(cores) < 2:
        raise RuntimeError("the async/sync comparison splits the cores between rollout and trainer: needs >= 2")
    half = len(cores) // 2
    return cores[half:], cores[:half]


def run(out: Path, checkpoint: Path, task: dict[str, Any], *, quick: bool, seed: int = 0,
        steps: int | None = None, only: list[str] | None = None, n_seeds: int | None = None,
        done: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The modes (``modes(quick, only)``) at RL seeds ``seed, seed + 1, ...`` (``n_seeds``, by
    default ``SEEDS``; one with ``quick``), all from one warm start, ``steps`` RL steps each
    (``tasks.run_steps``). ``modes`` holds the first seed's runs (the plots are theirs),
    ``seed_runs`` every seed's, and ``summary`` each mode's ratios and accuracies over the seeds.
    ``done``: ``runs.measured_run``'s record of the runs made, for the parts after this one."""
    steps, warmup = tasks.run_steps(quick, steps)
    seeds = list(range(seed, seed + (n_seeds or (1 if quick else SEEDS))))
    rollout_cores, trainer_cores = split_cores()
    by_seed = []
    for s in seeds:
        rows = []
        for name, mode, eta, overrides in modes(quick, only):
            cfg = tasks.run_config(task, checkpoint, out / "runs" / f"{name}_seed{s}", steps=steps, seed=s,
                                   **{"rollout.mode": mode, "rollout.max_staleness": eta, **overrides})
            split = mode == "async"
            row = runs.measured_run(cfg, rollout_cores=rollout_cores if split else None,
                                    trainer_cores=trainer_cores if split else None, warmup_steps=warmup,
                                    own_process=split and not quick, done=done)
            row.update(name=name, mode=mode, max_staleness=eta, seed=s)
            rows.append(row)
            print(f"  {name:<12} seed {s}: {row['wall_s_per_step']:.2f} s/step, "
                  f"{row['generated_tokens_per_s']:.0f} gen tok/s, idle trainer {row['trainer_idle_fraction']:.0%} "
                  f"rollout {row['rollout_idle_fraction']:.0%} (in prefill {row['rollout_prefill_share']:.0%}, "
                  f"paused {row['rollout_paused_share']:.0%}), "
                  f"accuracy {row['accuracy_before']:.0%} -> {row['accuracy_after']:.0%}", flush=True)
        compare(rows)
        by_seed.append(rows)
    data = {**report.core_split_header("async", steps=steps, warmup=warmup, seed=seed,
                                       rollout_cores=rollout_cores, trainer_cores=trainer_cores),
            "seeds": seeds, "accuracy_target": by_seed[0][0]["accuracy_target"],
            "config": tasks.run_config(task, checkpoint, out / "runs"), "modes": by_seed[0],
            "seed_runs": [r for rows in by_seed for r in rows], "summary": summary(by_seed),
            "plots": plot(by_seed[0], out)}
    report.write_json(out, "async", data)
    return data


def summary(by_seed: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per mode, over the seeds (each compared with its own seed's synchronous run): the mean and
    sample standard deviation (0 with one seed) of the per-step and trained-token ratios and of
    the final accuracy and its difference from the synchronous run's, how many seeds ended within
    noise of it, and each seed's ratio to the same accuracy."""
    out = []
    for i, first in enumerate(by_seed[0]):
        mine = [rows[i] for rows in by_seed]
        row: dict[str, Any] = {"name": first["name"], "max_staleness": first["max_staleness"],
                               "seeds": [r["seed"] for r in mine]}
        for key in ("sync_over_this_wall", "sync_over_this_steady", "this_over_sync_trained_tokens", "accuracy_after",
                    "accuracy_difference", "wall_s_per_step", "steady_s_per_step", "compile_s_per_step",
                    "answer_len_mean", "split_bound"):
            row[f"{key}_mean"], row[f"{key}_std"] = report.mean_sd([r[key] for r in mine if r.get(key) is not None])
        row["within_noise"] = sum(bool(r.get("accuracy_within_noise")) for r in mine)
        row["sync_over_this_to_accuracy"] = [r.get("sync_over_this_to_accuracy") for r in mine]
        out.append(row)
    return out


def compare(rows: list[dict[str, Any]]) -> None:
    """Add to each row (the synchronous baseline first) its ratios to the baseline.

    - ``sync_over_this_wall``: per step; ``sync_over_this_steady``: per step with each run's
      trainer compilation left out; ``this_over_sync_trained_tokens``: in trained tokens/s.
    - ``accuracy_difference`` (final held-out accuracy minus the baseline's), its standard error
      ``accuracy_difference_se`` (both runs' binomial errors over their held-out prompts), and
      ``accuracy_within_noise``: the difference is above -2 standard errors.
    - ``sync_over_this_to_accuracy``, the ratio of wall-clock to the same accuracy, as AReaL's
      comparison takes it: both runs train the same steps, so when the final accuracies agree
      within noise it is the ratio of the runs' training time (the per-step ratio); None when this
      run ended worse than the baseline by more than noise.
    - ``seconds_to_accuracy`` and ``sync_over_this_first_reach``: the training seconds to the
      first evaluation at or above the baseline's final accuracy, and the baseline's over this
      run's (None when not reached, or when the baseline never improved on its start). With a
      few noisy evaluations per run this is coarse; it is kept beside the ratio above.
    """
    sync = rows[0]
    target = sync["accuracy_after"]
    sync_s = runs.seconds_to(sync["accuracy_clock"], target)
    for r in rows:
        r["accuracy_target"] = target
        r["sync_over_this_wall"] = sync["wall_s_per_step"] / r["wall_s_per_step"]
        r["sync_over_this_steady"] = sync["steady_s_per_step"] / r["steady_s_per_step"]
        r["split_bound"] = split_bound(sync, r)
        r["this_over_sync_trained_tokens"] = r["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
        diff, se = _difference(r, sync)
        r["accuracy_difference"], r["accuracy_difference_se"] = diff, se
        r["accuracy_within_noise"] = None if diff is None else bool(diff >= -2 * se)
        r["sync_over_this_to_accuracy"] = r["sync_over_this_wall"] if r["accuracy_within_noise"] else None
        r["seconds_to_accuracy"] = runs.seconds_to(r["accuracy_clock"], target)
        mine = r["seconds_to_accuracy"]
        if not sync_s or mine is None:  # the baseline did not improve, or this run never got there
            r["sync_over_this_first_reach"] = None
        else:
            r["sync_over_this_first_reach"] = sync_s / mine if mine > 0 else float("inf")


def split_bound(sync: dict[str, Any], r: dict[str, Any]) -> float | None:
    """The most an asynchronous run can gain per step over ``sync`` with the trainer it had: a
    step is never shorter than its own training (on half the cores, slower than the synchronous
    run's on all of them), so ``sync s/step / this run's train s/step``. Where the synchronous
    trainer sat idle a fraction ``i`` of a step, that is ``1 / ((1 - i) x slowdown)``: 2x needs
    generation to be well over half of a synchronous step. None for the synchronous run."""
    if r is sync or not r.get("train_s_per_step"):
        return None
    return sync["wall_s_per_step"] / r["train_s_per_step"]


def _difference(r: dict[str, Any], sync: dict[str, Any]) -> tuple[float | None, float]:
    """``(this run's final accuracy - the baseline's, its standard error)``; (None, nan) without
    both accuracies."""
    a, b = r.get("accuracy_after"), sync.get("accuracy_after")
    if a is None or b is None:
        return None, float("nan")
    na, nb = r.get("eval_prompts") or 0, sync.get("eval_prompts") or 0
    var = (a * (1 - a) / na if na else 0.0) + (b * (1 - b) / nb if nb else 0.0)
    return a - b, var ** 0.5


def plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    plt = report.pyplot()
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [r["wall_s_per_step"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("wall-clock s / step")
    axes[1].bar(names, [r["generated_tokens_per_s"] for r in rows], color="tab:green")
    axes[1].set_ylabel("generated tokens / s")
    x = range(len(rows))
    axes[2].bar([i - 0.2 for i in x], [r["trainer_idle_fraction"] for r in rows], 0.4, label="trainer")
    axes[2].bar([i + 0.2 for i in x], [r["rollout_idle_fraction"] for r in rows], 0.4, label="rollout")
    axes[2].set_xticks(list(x), names)
    axes[2].set_ylabel("fraction of time idle")
    axes[2].set_ylim(0, 1)
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    paths = [report.save(fig, out / "async_throughput.png")]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in rows:
        ax.plot(r["step_end_s"], r["reward_curve"], marker=".", label=r["name"])
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("mean reward of the step's batch")
    ax.legend()
    paths.append(report.save(fig, out / "async_reward_vs_time.png"))
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in rows:
        clock = [(t, a) for t, a in r["accuracy_clock"] if a is not None]
        ax.plot([t for t, _ in clock], [a for _, a in clock], marker="o", label=r["name"])
    ax.axhline(rows[0]["accuracy_target"], color="gray", lw=0.8, ls=":", label="sync's final accuracy")
    ax.set_xlabel("training seconds (held-out evaluations left out)")
    ax.set_ylabel("held-out accuracy")
    ax.legend()
    paths.append(report.save(fig, out / "async_accuracy_vs_time.png"))
    return paths
