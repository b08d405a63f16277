"""The staleness ablation (a small AReaL Table 2): naive PPO (the ratio taken against the
behavior policy) against decoupled PPO (against the recomputed proximal policy, behavior
importance weights capped) at several ``max_staleness``, same checkpoint and steps, over several
RL seeds (one RL run's final accuracy moves by more than the held-out estimate's error from seed
to seed, so one seed per cell cannot rank the losses).

Reports each run's final held-out accuracy, its reward curve and the staleness it actually
trained on (``max_staleness`` is a bound; rollout only runs that far ahead when it is faster
than the trainer), and per cell the mean and spread over seeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench import report, runs, tasks

ALGORITHMS = ("naive", "decoupled")
MINIBATCH_CHECK = {"max_staleness": 8, "ppo_n_minibatches": 4}
"""A second set of cells: both losses at this staleness with this many optimizer steps per batch
(AReaL's recipes take 4). With one step per batch the policy being trained is the proximal one,
so decoupled PPO's ratio is exactly 1 and its clip never binds: it is then an importance-weighted
policy gradient with no trust region, while naive PPO's ratio against the behavior policy still
clips. Several steps per batch give the decoupled clip something to bind on."""


def settings(quick: bool) -> tuple[list[int], int, int]:
    """``(max_staleness values, steps, seeds)``."""
    return ([4], 3, 1) if quick else ([0, 1, 2, 4, 8], 40, 3)


def run(out: Path, checkpoint: Path, task: dict[str, Any], *, quick: bool, seed: int = 0) -> dict[str, Any]:
    """Every (algorithm, max_staleness) cell at RL seeds ``seed, seed + 1, ...``, all from one warm start."""
    etas, steps, n_seeds = settings(quick)
    seeds = list(range(seed, seed + n_seeds))
    rows = [one_run(out, checkpoint, task, algorithm, eta, s, steps)
            for s in seeds for eta in etas for algorithm in ALGORITHMS]
    check: list[dict[str, Any]] = []
    if not quick:
        check = minibatch_check(out, checkpoint, task, seeds, steps)
    table = cells(rows, etas)
    data = {"part": "staleness", "conditions": report.conditions(), "steps": steps, "seed": seed, "seeds": seeds,
            "max_staleness": etas, "runs": rows, "cells": table, "minibatch_check": check,
            "plots": plot(rows, table, etas, out)}
    report.write_json(out, "staleness", data)
    return data


def one_run(out: Path, checkpoint: Path, task: dict[str, Any], algorithm: str, eta: int, seed: int, steps: int,
            minibatches: int = 1) -> dict[str, Any]:
    name = f"{algorithm}_eta{eta}_seed{seed}" + (f"_mb{minibatches}" if minibatches > 1 else "")
    cfg = tasks.run_config(task, checkpoint, out / "runs" / name, steps=steps, seed=seed,
                           **{"rollout.mode": "async", "rollout.max_staleness": eta,
                              "algo.use_decoupled_loss": algorithm == "decoupled",
                              "algo.ppo_n_minibatches": minibatches})
    row = runs.measured_run(cfg, rollout_cores=None, trainer_cores=None, warmup_steps=1)
    row.update(name=name, algorithm=algorithm, max_staleness=eta, seed=seed, ppo_n_minibatches=minibatches)
    print(f"  {name:<24} accuracy {row['accuracy_before']:.0%} -> {row['accuracy_after']:.0%}, "
          f"mean staleness {row['staleness_mean']:.2f}", flush=True)
    return row


def minibatch_check(out: Path, checkpoint: Path, task: dict[str, Any], seeds: list[int],
                    steps: int) -> list[dict[str, Any]]:
    """``MINIBATCH_CHECK``'s cells (each seed's runs under ``runs``)."""
    eta, mb = MINIBATCH_CHECK["max_staleness"], MINIBATCH_CHECK["ppo_n_minibatches"]
    rows = [one_run(out, checkpoint, task, algorithm, eta, s, steps, minibatches=mb)
            for s in seeds for algorithm in ALGORITHMS]
    return [{**c, "ppo_n_minibatches": mb, "runs": [r for r in rows if r["algorithm"] == c["algorithm"]]}
            for c in cells(rows, [eta])]


def cells(rows: list[dict[str, Any]], etas: list[int]) -> list[dict[str, Any]]:
    """Per (algorithm, max_staleness): the seeds' final accuracies, their mean and sample standard
    deviation (0 with one seed), and the mean staleness trained on."""
    out = []
    for eta in etas:
        for algorithm in ALGORITHMS:
            mine = [r for r in rows if r["algorithm"] == algorithm and r["max_staleness"] == eta]
            acc = [float(r["accuracy_after"]) for r in mine]
            mean, sd = report.mean_sd(acc)
            out.append({"algorithm": algorithm, "max_staleness": eta, "seeds": [r["seed"] for r in mine],
                        "accuracy_after": acc, "accuracy_mean": mean, "accuracy_std": sd,
                        "accuracy_before": mine[0]["accuracy_before"],
                        "staleness_mean": float(np.mean([r["staleness_mean"] for r in mine]))})
    return out


def plot(rows: list[dict[str, Any]], table: list[dict[str, Any]], etas: list[int], out: Path) -> list[str]:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for algorithm, style, shift in (("naive", "o--", -0.06), ("decoupled", "s-", 0.06)):
        mine = [c for c in table if c["algorithm"] == algorithm]
        x = np.arange(len(etas)) + shift
        axes[0].errorbar(x, [c["accuracy_mean"] for c in mine], yerr=[c["accuracy_std"] for c in mine],
                         fmt=style, capsize=3, label=f"{algorithm} (mean ± sd over seeds)")
        for i, c in enumerate(mine):
            axes[0].plot([x[i]] * len(c["accuracy_after"]), c["accuracy_after"], ".", color="gray", ms=4)
    axes[0].set_xticks(range(len(etas)), [str(e) for e in etas])
    axes[0].axhline(rows[0]["accuracy_before"], color="gray", lw=0.8, ls=":", label="before RL")
    axes[0].set_xlabel("max_staleness")
    axes[0].set_ylabel("final held-out accuracy")
    axes[0].legend(fontsize=8)
    for algorithm, color in (("naive", "tab:orange"), ("decoupled", "tab:blue")):
        for eta, lw in zip(etas, np.linspace(0.6, 2.0, len(etas)), strict=True):
            curves = np.array([r["reward_curve"] for r in rows
                               if r["algorithm"] == algorithm and r["max_staleness"] == eta], float)
            axes[1].plot(range(1, curves.shape[1] + 1), curves.mean(0), "--" if algorithm == "naive" else "-",
                         color=color, lw=lw, label=f"{algorithm} eta {eta}")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("mean reward of the step's batch (mean over seeds)")
    axes[1].legend(fontsize=7, ncol=2)
    return [report.save(fig, out / "staleness.png")]
