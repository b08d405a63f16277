"""Interruptible weight updates: each update pauses the server with ``abort`` and the answers in
flight resume under the new weights, their KV recomputed (``rollout.interruptible: true``, as
AReaL does), or pauses it ``in_place`` and the answers go on over their stale KV (as PipelineRL
does), against updates that first stop starting episodes and wait for the ones in flight to
finish (``false``). Same checkpoint, seed, steps and core split as the asynchronous runs of
``async_sync``: in one invocation with the async part, its ``async_eta4`` run at the same seed is
the same run as ``interrupt`` here, and is not made twice (the row says ``same_run_as``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_jax.bench import async_sync, report, runs, tasks


def run(out: Path, checkpoint: Path, task: dict[str, Any], *, quick: bool, seed: int = 0,
        steps: int | None = None, done: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The three runs (``done``: the runs the async part made, by ``runs.run_key``; its
    ``async_eta4`` run at this seed is this part's interruptible one, whose figures it reuses)."""
    (steps, warmup), eta = tasks.run_steps(quick, steps), 4
    rollout_cores, trainer_cores = async_sync.split_cores()
    rows = []
    for name, interruptible, pause_mode in (("wait", False, "abort"), ("interrupt", True, "abort"),
                                            ("in_place", True, "in_place")):
        cfg = tasks.run_config(task, checkpoint, out / "runs" / f"update_{name}", steps=steps, seed=seed,
                               **{"rollout.mode": "async", "rollout.max_staleness": eta,
                                  "rollout.interruptible": interruptible, "rollout.pause_mode": pause_mode})
        row = runs.measured_run(cfg, rollout_cores=rollout_cores, trainer_cores=trainer_cores, warmup_steps=warmup,
                                own_process=not quick, done=done)
        row.update(name=name, interruptible=interruptible, pause_mode=pause_mode, max_staleness=eta)
        rows.append(row)
        print(f"  {name:<10} {row['wall_s_per_step']:.2f} s/step, {row['generated_tokens_per_s']:.0f} gen tok/s, "
              f"{row['trained_tokens_per_s']:.0f} trained tok/s, update {row['weight_sync_s_per_step']:.2f} s",
              flush=True)
    wait, inter, in_place = rows
    data = {**report.core_split_header("interrupt", steps=steps, warmup=warmup, seed=seed,
                                       rollout_cores=rollout_cores, trainer_cores=trainer_cores), "runs": rows,
            "throughput_ratio": inter["trained_tokens_per_s"] / wait["trained_tokens_per_s"],
            "wall_ratio": wait["wall_s_per_step"] / inter["wall_s_per_step"],
            "in_place_throughput_ratio": in_place["trained_tokens_per_s"] / wait["trained_tokens_per_s"],
            "in_place_wall_ratio": wait["wall_s_per_step"] / in_place["wall_s_per_step"],
            "plots": plot(rows, out)}
    report.write_json(out, "interrupt", data)
    return data


def plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    plt = report.pyplot()
    names = [r["name"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, label in ((axes[0], "wall_s_per_step", "wall-clock s / step"),
                           (axes[1], "trained_tokens_per_s", "trained answer tokens / s"),
                           (axes[2], "weight_sync_s_per_step", "update (wait + push) s / step")):
        ax.bar(names, [r[key] for r in rows], color=["tab:orange", "tab:blue", "tab:green"][:len(rows)])
        ax.set_ylabel(label)
    return [report.save(fig, out / "interrupt.png")]
