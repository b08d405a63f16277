"""One rollout server under an asynchronous GRPO run's load, with and without shared prefills.

The server (``areal-jax serve``, the long-tail bench's warm-started model and server flags) runs
pinned to one core; this process, on the other, keeps ``--groups`` groups of ``--group-size``
answers to one prompt in flight through the real HTTP client, as the controller does at
``max_staleness`` 4, and every ``--period`` seconds pauses the server (``--pause`` mode), pushes
weights (the same checkpoint, from disk, under a new version) and continues it, as the trainer
does after each step. ``--pause none`` pushes nothing. For each pause mode, the server runs with
its prefills shared between requests that send the same tokens (the default) and with
``--disable-radix-cache``, alternating, ``--rounds`` times; with ``--compare batch`` it alternates
instead between each group asked as one request (SGLang's batch form, the client's default) and
one request per answer, prefills shared in both. Reports generated tokens/s, answers/s,
prompt tokens per generated token and how many of them were prefilled rather than shared
(recomputation after a pause shows here) and computed with the prefill calls' padding, the
server's CPU split between XLA's threads and Python's, and how long each pause-push-continue kept
the server stopped.

    python benchmarks/rollout_load.py [--pause none,abort,retract,in_place] [--rounds 2] [--compare share|batch]
                                      [--out f.json]

The first run trains the warm start (400 supervised steps, about a minute) into ``--work``.
Needs two cores (the server on the last, this process on the first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.bench import runs, tasks
from areal_jax.data import load_prompts
from areal_jax.data.datasets import DatasetConfig
from areal_jax.models import load_tokenizer
from rollout_bridge.client import ClientConfig, HttpRolloutClient
from rollout_bridge.launcher import ServerFleet


def _metrics(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        return runs.metric_values(r.read().decode())


def _thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by thread name with digits dropped."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            name = re.sub(r"\d+", "", open(f"/proc/{pid}/task/{tid}/comm").read().strip())
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


async def _load(address: str, prompts: list[list[int]], args: argparse.Namespace, pause: str,
                batch: bool) -> dict[str, Any]:
    sampling = {"max_new_tokens": tasks.LONG_TAIL_TASK["rollout"]["max_new_tokens"], "temperature": 1.0}
    done = {"tokens": 0, "answers": 0}
    windows: list[float] = []
    stop = [0.0]
    async with HttpRolloutClient([address], config=ClientConfig(batch_requests=batch)) as client:
        async def group(i: int) -> None:
            answers = await client.generate_many([list(prompts[i % len(prompts)])] * args.group_size, sampling)
            done["tokens"] += sum(len(r.output_ids) for r in answers)
            done["answers"] += len(answers)

        async def lane(k: int) -> None:
            i = k
            while time.perf_counter() < stop[0]:
                await group(i)
                i += args.groups

        async def pusher() -> None:
            version = 1
            while time.perf_counter() < stop[0]:
                await asyncio.sleep(args.period)
                t = time.perf_counter()
                await client.pause(pause)
                await client.update_weights_from_disk(str(Path(args.model).absolute()), version=version)
                await client.continue_generation()
                windows.append(time.perf_counter() - t)
                version += 1

        stop[0] = time.perf_counter() + 3600
        await asyncio.gather(*(group(i) for i in range(4)))  # every shape the load meets, once
        done.update(tokens=0, answers=0)
        before, t0 = _metrics(address), time.perf_counter()
        stop[0] = t0 + args.seconds
        await asyncio.gather(*(lane(k) for k in range(args.groups)), *([pusher()] if pause != "none" else []))
        elapsed, after = time.perf_counter() - t0, _metrics(address)
    delta = lambda key: after[key] - before[key]
    gen = delta("sglang:generation_tokens_total")
    return {"tokens_per_s": done["tokens"] / elapsed, "answers_per_s": done["answers"] / elapsed,
            "answer_len_mean": done["tokens"] / max(done["answers"], 1),
            "prompt_tokens_per_generated": delta("sglang:prompt_tokens_total") / max(gen, 1),
            "prefilled_tokens_per_generated": (delta("sglang:prompt_tokens_total")
                                               - delta("areal_jax:shared_prompt_tokens_total")) / max(gen, 1),
            "padded_prefill_tokens_per_generated": delta("areal_jax:prefill_padded_tokens_total") / max(gen, 1),
            "pushes": len(windows), "pause_window_ms": 1000 * float(np.mean(windows)) if windows else 0.0,
            "seconds": elapsed}


def measure(args: argparse.Namespace, prompts: list[list[int]], pause: str, share: bool,
            batch: bool = True) -> dict[str, Any]:
    everything = sorted(os.sched_getaffinity(0))
    server_core, own = everything[-1:], everything[:1]
    flags = [a for a in tasks.LONG_TAIL_TASK["rollout"]["server_args"] if a != "--server-warmup"]
    flags += ["--weight-roots", str(Path(args.model).absolute().parent)]
    if not share:
        flags.append("--disable-radix-cache")
    with runs.thread_affinity(server_core):
        fleet = ServerFleet(args.model, 1, Path(args.work) / "logs", extra_args=[*flags, "--server-warmup"], seed=0)
        (address,) = fleet.start()
    try:
        os.sched_setaffinity(0, own)
        pid = fleet.children[0].proc.pid
        cpu0, t0 = _thread_cpu(pid), time.perf_counter()
        out = asyncio.run(_load(address, prompts, args, pause, batch))
        wall = time.perf_counter() - t0
        cpu = {k: v - cpu0.get(k, 0.0) for k, v in _thread_cpu(pid).items()}
    finally:
        os.sched_setaffinity(0, everything)
        fleet.stop()
    xla = sum(v for k, v in cpu.items() if "XLA" in k or "Eigen" in k)
    out.update(pause=pause, share=share, batch=batch, server_xla_cpu=xla / wall,
               server_other_cpu=(sum(cpu.values()) - xla) / wall)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pause", default="none,abort,retract,in_place", help="pause modes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="alternating shared / unshared runs per mode")
    ap.add_argument("--groups", type=int, default=40, help="groups in flight ((max_staleness + 1) x batch size)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--period", type=float, default=0.45, help="seconds between weight pushes (one RL step)")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed seconds per run")
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the long-tail warm start in --work)")
    ap.add_argument("--work", default="runs/rollout_load")
    ap.add_argument("--compare", choices=("share", "batch"), default="share",
                    help="what alternates: shared prefills on / off, or a group per request / an answer per request")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs two cores: the server on one, the client on another")
    cfg = tasks.task_config(False, tasks.LONG_TAIL_TASK)
    if args.model is None:
        args.model = str(tasks.warm_checkpoint({**cfg, "seed": 0}, Path(args.work) / "checkpoint",
                                               scratch=tasks.LONG_TAIL_SCRATCH))
    data = load_prompts(DatasetConfig(**{**cfg["data"], "eval_size": 100}), load_tokenizer(args.model))
    prompts = [list(r.prompt_ids) for r in data.train_rows]
    results = []
    key, label = ("share", "shared prefill") if args.compare == "share" else ("batch", "a group per request")
    for pause in args.pause.split(","):
        for _ in range(args.rounds):
            for on in (True, False):
                r = measure(args, prompts, pause, **{"share": True, "batch": True, key: on})
                results.append(r)
                print(f"pause {pause:8s} {label} {'on ' if on else 'off'}: {r['tokens_per_s']:6.0f} tok/s, "
                      f"{r['answers_per_s']:4.0f} answers/s, per generated token "
                      f"{r['prompt_tokens_per_generated']:.2f} prompt tokens, "
                      f"{r['prefilled_tokens_per_generated']:.2f} prefilled "
                      f"({r['padded_prefill_tokens_per_generated']:.2f} with padding); "
                      f"{r['pushes']} pushes stopping the server {r['pause_window_ms']:.0f} ms each; "
                      f"server CPU: XLA {100 * r['server_xla_cpu']:.0f}%, other {100 * r['server_other_cpu']:.0f}%",
                      flush=True)
    print(f"\n| pause | {label} on: tok/s | off: tok/s | on / off | prefilled tokens per generated (on, off) "
          "| server CPU in Python (on, off) |")
    print("|---|---|---|---|---|---|")
    for pause in args.pause.split(","):
        on = [r for r in results if r["pause"] == pause and r[key]]
        off = [r for r in results if r["pause"] == pause and not r[key]]
        mean = lambda rs, k: float(np.mean([r[k] for r in rs]))
        print(f"| {pause} | {mean(on, 'tokens_per_s'):.0f} | {mean(off, 'tokens_per_s'):.0f} | "
              f"{mean(on, 'tokens_per_s') / mean(off, 'tokens_per_s'):.2f}x | "
              f"{mean(on, 'prefilled_tokens_per_generated'):.2f}, {mean(off, 'prefilled_tokens_per_generated'):.2f} | "
              f"{100 * mean(on, 'server_other_cpu'):.0f}%, {100 * mean(off, 'server_other_cpu'):.0f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps({"utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                                              "args": vars(args), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
