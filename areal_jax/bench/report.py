"""What every part writes: a JSON file with the conditions it ran under, and PNG plots."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any


def conditions() -> dict[str, Any]:
    """The machine and its load, to state beside the figures (other work shares the cores)."""
    return {
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "cpu": _cpu_name(),
        "python": platform.python_version(),
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def core_split_header(part: str, *, steps: int, warmup: int, seed: int, rollout_cores: list[int],
                      trainer_cores: list[int]) -> dict[str, Any]:
    """The head of a part's JSON for runs with rollout and trainer on separate cores."""
    return {"part": part, "conditions": conditions(), "steps": steps, "warmup_steps": warmup, "seed": seed,
            "rollout_cores": rollout_cores, "trainer_cores": trainer_cores}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def mean_sd(values: list[float]) -> tuple[float | None, float]:
    """The mean and sample standard deviation of one figure over seeds: (None, 0) with no values,
    a standard deviation of 0 with one."""
    if not values:
        return None, 0.0
    return sum(values) / len(values), statistics.stdev(values) if len(values) > 1 else 0.0


def write_json(out: Path, name: str, data: dict[str, Any]) -> Path:
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return str(path)
