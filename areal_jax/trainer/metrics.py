"""Run metrics: one JSON line per train step in ``<run dir>/metrics.jsonl``, mirrored to
TensorBoard and (when configured) wandb, a progress bar, and the end-of-run plots.

A resumed run (``start_step`` > 0) keeps the lines of steps up to ``start_step`` and drops any
later ones (written after the checkpoint it resumes from, or cut short by a kill), and
TensorBoard hides its events from ``start_step + 1`` on, so no step appears twice.

Only process 0 of a multi-host run writes. Non-numeric values stay in the JSONL line and are
left out of TensorBoard and wandb.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from areal_jax.trainer.tensorboard import EventWriter


@dataclass
class LogConfig:
    """Where a run's metrics go besides ``metrics.jsonl``."""

    tensorboard: bool = True
    """Write TensorBoard events to ``<run dir>/tensorboard``."""
    wandb_project: str | None = None
    """Mirror to wandb under this project; None: no wandb."""
    wandb_mode: str = "offline"
    """``offline`` (no network; ``wandb sync`` later), ``online`` or ``disabled``."""
    progress: bool = True
    """A progress bar on the terminal (or the notebook) showing reward, staleness and version."""


class MetricsLogger:
    """Writes step metrics to JSONL, TensorBoard and wandb; shows a progress bar."""

    def __init__(self, run_dir: str | Path, cfg: LogConfig | None = None, *, total_steps: int | None = None,
                 run_config: dict[str, Any] | None = None, start_step: int = 0):
        self.cfg = cfg or LogConfig()
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.writer: EventWriter | None = None
        self._file = self._wandb = self._bar = None
        self.history: list[dict[str, Any]] = []
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A run that starts at step 0 replaces the metrics of an earlier run in the same directory.
        if start_step and self.path.exists():
            self.history = [m for m in _complete_lines(self.path) if int(m["step"]) <= start_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(m) + "\n" for m in self.history))
            tmp.replace(self.path)
        if self.cfg.tensorboard:
            if not start_step:
                for old in (self.run_dir / "tensorboard").glob("events.out.tfevents.*"):
                    old.unlink()
            # Events of steps >= purge_step written before this writer started are hidden.
            self.writer = EventWriter(self.run_dir / "tensorboard", purge_step=start_step + 1 if start_step else None,
                                      filename_suffix=f".resumed-{start_step}" if start_step else "")
        self._file = self.path.open("a" if start_step else "w")
        if self.cfg.wandb_project and self.cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=self.cfg.wandb_project, dir=str(self.run_dir), mode=self.cfg.wandb_mode,
                                     config=run_config or {}, reinit="finish_previous")
        if self.cfg.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="RL", unit="step", dynamic_ncols=True)

    def log(self, metrics: dict[str, Any]) -> None:
        """One step's metrics; ``metrics['step']`` is the x axis everywhere."""
        self.history.append(metrics)
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics, default=_jsonable) + "\n")
        self._file.flush()
        step = int(metrics["step"])
        scalars = {k: float(v) for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
        if self.writer is not None:
            self.writer.add_scalars({k: v for k, v in scalars.items() if k != "step"}, step)
            self.writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        if self._bar is not None:
            post = {"reward": metrics.get("reward_mean"), "stale": metrics.get("staleness_max"),
                    "v": metrics.get("version")}
            if metrics.get("eval_accuracy") is not None:
                post["eval_acc"] = metrics["eval_accuracy"]
            self._bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in post.items()
                                   if v is not None}, refresh=False)
            self._bar.update(1)

    def write(self, message: str) -> None:
        """A line of text that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.writer is not None:
            self.writer.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._file is not None:
            self._file.close()
        self._bar = self.writer = self._wandb = self._file = None


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _complete_lines(path: Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl`` that a kill did not cut short."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(history: list[dict[str, Any]], out: str | Path, *, eval_before: dict[str, Any] | None = None) -> Path:
    """A PNG: reward and held-out accuracy against step (left) and wall-clock time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    steps = [m["step"] for m in history]
    times = [m["time"] / 60 for m in history]
    rewards = [m.get("reward_mean") for m in history]
    evals = [(m["step"], m["time"] / 60, m["eval_accuracy"]) for m in history if m.get("eval_accuracy") is not None]
    if eval_before and eval_before.get("eval_accuracy") is not None:  # an empty held-out split gives {}
        evals.insert(0, (0, eval_before.get("time", 0.0) / 60, eval_before["eval_accuracy"]))
    for ax, xs, xe, label in ((axes[0], steps, [e[0] for e in evals], "step"),
                              (axes[1], times, [e[1] for e in evals], "wall-clock minutes")):
        ax.plot(xs, rewards, label="reward (train batch)", color="tab:blue", alpha=0.8)
        if evals:
            ax.plot(xe, [e[2] for e in evals], "o-", label="held-out accuracy", color="tab:orange")
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("reward / accuracy")
    axes[0].legend(loc="lower right")
    fig.suptitle(f"RL run ({time.strftime('%Y-%m-%d %H:%M')})")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
