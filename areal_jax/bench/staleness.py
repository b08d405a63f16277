"""The staleness ablation (a small AReaL Table 2): naive PPO (the ratio taken against the
behavior policy) against decoupled PPO (against the recomputed proximal policy, behavior
importance weights capped) at several ``max_staleness``, same checkpoint, seed and steps.

Reports each run's final held-out accuracy, its reward curve and the staleness it actually
trained on (``max_staleness`` is a bound; rollout only runs that far ahead when it is faster
than the trainer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_jax.bench import report, runs


def settings(quick: bool) -> tuple[list[int], int]:
    """``(max_staleness values, steps)``."""
    return ([4], 3) if quick else ([0, 1, 2, 4, 8], 40)


def run(out: Path, checkpoint: Path, task: dict[str, Any], *, quick: bool, seed: int = 0) -> dict[str, Any]:
    etas, steps = settings(quick)
    rows = []
    for eta in etas:
        for decoupled in (False, True):
            name = f"{'decoupled' if decoupled else 'naive'}_eta{eta}"
            cfg = runs.run_config(task, checkpoint, out / "runs" / name, steps=steps, seed=seed,
                                  **{"rollout.mode": "async", "rollout.max_staleness": eta,
                                     "algo.use_decoupled_loss": decoupled})
            row = runs.measured_run(cfg, rollout_cores=None, trainer_cores=None, warmup_steps=1)
            row.update(name=name, algorithm="decoupled" if decoupled else "naive", max_staleness=eta)
            rows.append(row)
            print(f"  {name:<14} accuracy {row['accuracy_before']:.0%} -> {row['accuracy_after']:.0%}, "
                  f"mean staleness {row['staleness_mean']:.2f}", flush=True)
    data = {"part": "staleness", "conditions": report.conditions(), "steps": steps, "seed": seed,
            "max_staleness": etas, "runs": rows, "plots": plot(rows, etas, out)}
    report.write_json(out, "staleness", data)
    return data


def plot(rows: list[dict[str, Any]], etas: list[int], out: Path) -> list[str]:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for algo, style in (("naive", "o--"), ("decoupled", "s-")):
        acc = [next(r["accuracy_after"] for r in rows if r["algorithm"] == algo and r["max_staleness"] == e)
               for e in etas]
        axes[0].plot([str(e) for e in etas], acc, style, label=algo)
    before = rows[0]["accuracy_before"]
    axes[0].axhline(before, color="gray", lw=0.8, ls=":", label="before RL")
    axes[0].set_xlabel("max_staleness")
    axes[0].set_ylabel("final held-out accuracy")
    axes[0].legend()
    for r in rows:
        axes[1].plot(range(1, len(r["reward_curve"]) + 1), r["reward_curve"],
                     "--" if r["algorithm"] == "naive" else "-", label=r["name"], lw=1)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("mean reward of the step's batch")
    axes[1].legend(fontsize=7, ncol=2)
    return [report.save(fig, out / "staleness.png")]
