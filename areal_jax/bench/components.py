"""The component benchmarks of ``benchmarks/`` under one entry: each script runs in its own
process (a fresh JAX runtime, as when run by hand) and writes its JSON, which this part
collects and plots.

- decode: engine tokens/s against concurrency;
- train_step: trainer tokens/s and the fraction of the float32 matmul peak measured in the same run;
- weight_update: disk and HTTP weight updates against a raw safetensors write + read of the same bytes
  (medians; each push's ratio to the write + read measured right after it);
- rewards: reward-pool rewards/s against inline calls.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from areal_jax.bench import report

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"

ARGS: dict[str, tuple[list[str], list[str]]] = {
    "decode": (["--concurrency", "1", "8", "--new-tokens", "16", "--rounds", "1", "--skip-transformers"],
               ["--concurrency", "1", "8", "32", "64", "--rounds", "3", "--skip-transformers"]),
    "train_step": (["--sizes", "tiny", "--groups", "2", "--group-size", "2", "--max-answer", "32", "--batches", "1",
                    "--reps", "1", "--budget", "512", "--padded-micro-batches", "1"],
                   ["--sizes", "tiny", "small", "--batches", "1", "--reps", "1"]),
    "weight_update": (["--sizes", "3M", "--repeats", "1"], ["--sizes", "3M,25M,100M", "--repeats", "3"]),
    "rewards": (["--calls", "20"], ["--calls", "200"]),
}
"""Each script's arguments, ``(quick, full)``."""


def run_script(name: str, args: list[str], out: Path, timeout_s: float = 1200.0) -> tuple[Any, float]:
    """Run ``benchmarks/<name>.py args --out <out>/components/<name>.json``; ``(its JSON, seconds)``."""
    script = SCRIPTS_DIR / f"{name}.py"
    if not script.exists():
        raise FileNotFoundError(f"{script}: the component benchmarks live in the source checkout's benchmarks/")
    target = out / "components" / f"{name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script), *args, "--out", str(target)], capture_output=True,
                          text=True, timeout=timeout_s, cwd=SCRIPTS_DIR.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/{name}.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(target.read_text()), time.perf_counter() - t0


def run(out: Path, *, quick: bool) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for name, (quick_args, full_args) in ARGS.items():
        raw[name], seconds = run_script(name, quick_args if quick else full_args, out)
        print(f"  {name:<14} {seconds:.0f}s", flush=True)
    data = {"part": "components", "conditions": report.conditions(), "quick": quick,
            "args": {k: (v[0] if quick else v[1]) for k, v in ARGS.items()}, **figures(raw), "raw": raw}
    data["plots"] = plot(data, out)
    report.write_json(out, "components", data)
    return data


def figures(raw: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of each script's JSON."""
    train = raw["train_step"]
    return {
        "decode": [{"concurrency": r["concurrency"], "tokens_per_s": r["engine"]["tok_s"],
                    "lanes": r["engine"]["lanes"]} for r in raw["decode"]["rows"]],
        "train_step": {"matmul_peak_gflops": 1e3 * train["matmul_peak_tflops_per_s"], "sizes": [
            {"size": s["size"], "params": s["params"], "tokens_per_s": s["tokens_per_s"],
             "fraction_of_matmul_peak": s["fraction_of_matmul_peak"],
             "attention_share": s["profile"]["attention_share"],
             "scores_computed_over_needed": s["profile"]["scores_computed_over_needed"]} for s in train["sizes"]]},
        "weight_update": [{"model": r["model"], "params": r["params"], "mib": r["bytes"] / 2**20,
                           "disk_s": r["disk_s"], "http_s": r["http_s"], "http_hf_s": r.get("http_hf_s"),
                           "raw_write_read_s": r["raw_write_s"] + r["raw_read_s"],
                           **{f"{k}_over_bound": r.get(f"{k}_over_bound") for k in ("disk", "http", "http_hf")}}
                          for r in raw["weight_update"]],
        "rewards": [{"reward": k, "inline_per_s": v["inline_per_s"], "pool_per_s": v["pool_per_s"],
                     "workers": v["workers"]} for k, v in raw["rewards"].items()],
    }


def plot(data: dict[str, Any], out: Path) -> list[str]:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    dec = data["decode"]
    axes[0].plot([r["concurrency"] for r in dec], [r["tokens_per_s"] for r in dec], "o-")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("concurrent requests")
    axes[0].set_ylabel("decode tokens / s")
    sizes = data["train_step"]["sizes"]
    axes[1].bar([s["size"] for s in sizes], [100 * s["fraction_of_matmul_peak"] for s in sizes])
    axes[1].set_ylabel(f"train step, % of matmul peak ({data['train_step']['matmul_peak_gflops']:.0f} GFLOP/s)")
    wu = data["weight_update"]
    x = range(len(wu))
    for i, (key, label) in enumerate((("disk_s", "disk"), ("http_s", "HTTP"), ("raw_write_read_s", "raw write+read"))):
        axes[2].bar([j + 0.27 * (i - 1) for j in x], [r[key] for r in wu], 0.27, label=label)
    axes[2].set_xticks(list(x), [f"{r['model']} ({r['mib']:.0f} MiB)" for r in wu])
    axes[2].set_ylabel("weight update s")
    axes[2].legend()
    rw = data["rewards"]
    x = range(len(rw))
    axes[3].bar([j - 0.2 for j in x], [r["inline_per_s"] for r in rw], 0.4, label="inline")
    axes[3].bar([j + 0.2 for j in x], [r["pool_per_s"] for r in rw], 0.4, label="pool")
    axes[3].set_xticks(list(x), [r["reward"] for r in rw])
    axes[3].set_ylabel("rewards / s")
    axes[3].legend()
    return [report.save(fig, out / "components.png")]
