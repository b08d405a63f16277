"""``areal-jax bench [--parts async,staleness,interrupt,components] [--quick] [--out DIR]``."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from areal_jax.bench import PARTS, report, runs, tasks
from areal_jax.trainer.startup import use_compile_cache


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="areal-jax bench", description=(
        "System benchmarks: async vs sync RL, the staleness ablation, interruptible weight updates and the "
        "component benchmarks; each part writes <out>/<part>.json and PNG plots."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    p.add_argument("--quick", action="store_true",
                   help="small settings: every part in a few minutes, a smoke test (runs on the same checkpoint, "
                        "server arguments, seed and cores share one rollout server, reset to the warm start; the "
                        "staleness part runs on the async part's task and warm start, not the demo's)")
    p.add_argument("--long-tail", action="store_true",
                   help="async and interrupt parts on tasks.LONG_TAIL_TASK: answers up to "
                        f"{tasks.LONG_TAIL_TASK['rollout']['max_new_tokens']} tokens with a long tail, "
                        "so generation is most of a synchronous step")
    p.add_argument("--out", default="runs/bench", help="results folder")
    p.add_argument("--seed", type=int, default=0, help="first RL seed of the async, staleness and interrupt parts")
    p.add_argument("--warm-start", choices=("shipped", "build"), default="shipped",
                   help="--long-tail's starting checkpoint: 'shipped' copies the one in areal_jax/bench/warm_starts/"
                        "long_tail (every long-tail result in docs/results.md starts from it); 'build' trains one now "
                        "(400 supervised steps, about 6 minutes), which with today's code is a different model. "
                        "The other tasks always build theirs")
    p.add_argument("--warm-start-seed", type=int, default=0,
                   help="seed of a built warm start (the tiny model's initial weights, the supervised steps and the "
                        "scratch lengths): every --seed of an invocation, and invocations with different --seed, "
                        "start RL from the same checkpoint")
    p.add_argument("--steps", type=int, default=None,
                   help="RL steps per run of the async and interrupt parts (default 30; 4 with --quick): longer runs "
                        "show whether a staleness bound stays stable")
    p.add_argument("--modes", default=None,
                   help="async part: comma-separated modes to run, e.g. async_eta4 (default all; the synchronous "
                        "baseline always runs, since every ratio is to it); async_eta4_naive (naive PPO) and "
                        "async_eta4_m2po (M2PO's trust region) run only when named")
    p.add_argument("--seeds", type=int, default=None,
                   help="async part: RL seeds per mode, from --seed on (default 3; 1 with --quick)")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache shared by every run and server (default <out>/jax_cache); "
                        "'none' turns it off")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    warmup = tasks.warmup_steps(args.quick)
    if args.steps is not None and args.steps <= warmup:
        p.error(f"--steps {args.steps} leaves no timed step: the first {warmup} steps compile and are left out of "
                f"the figures; give --steps {warmup + 1} or more")
    if args.modes is not None:
        from areal_jax.bench.async_sync import modes

        args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
        try:
            modes(args.quick, args.modes)
        except ValueError as e:
            p.error(str(e))
    if args.seeds is not None and args.seeds < 1:
        p.error(f"--seeds {args.seeds}: give 1 or more")
    unknown = [x for x in args.parts if x not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    return args


def main(argv: list[str]) -> dict[str, Any]:
    """Run the selected parts in order; returns ``{part: its JSON data}`` (also in ``<out>/summary.json``)."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.compile_cache != "none":
        # every run compiles the same functions (here and in each rollout server): the first one
        # fills the cache; compiling falls in the warm-up steps the figures leave out anyway
        use_compile_cache(str(Path(args.compile_cache or out / "jax_cache").absolute()), override=True)
    results: dict[str, Any] = {}
    done: dict[str, dict[str, Any]] = {}  # the measured runs made, so that no part makes one twice
    t0 = time.perf_counter()
    rl_parts = [p for p in args.parts if p in ("async", "staleness", "interrupt")]
    if rl_parts:
        task = tasks.task_config(args.quick, tasks.LONG_TAIL_TASK if args.long_tail else tasks.TASK)
        if "async" in rl_parts or "interrupt" in rl_parts:
            # its own folder: a warm start is reused when present, and the two tasks' differ
            folder = out / ("checkpoint_long_tail" if args.long_tail else "checkpoint")
            if args.long_tail and args.warm_start == "shipped":
                checkpoint = tasks.shipped_warm_start("long_tail", folder)
                print(f"warm start of the long-tailed task: the shipped one, copied to {checkpoint}", flush=True)
            else:
                print(f"warm start of the {'long-tailed ' if args.long_tail else ''}task "
                      f"({task['warm_start']['steps']} supervised steps) ...", flush=True)
                checkpoint = tasks.warm_checkpoint({**task, "seed": args.warm_start_seed}, folder,
                                                   scratch=tasks.LONG_TAIL_SCRATCH if args.long_tail else tasks.SCRATCH)
        if "staleness" in rl_parts and args.quick and ("async" in rl_parts or "interrupt" in rl_parts):
            # --quick is a smoke test of each part's code, its figures meaningless: the staleness
            # runs take the task and warm start made above, and with them a server already started
            # (runs.SharedServers), rather than a warm start and a server of the demo's task
            demo_task, demo_checkpoint = task, checkpoint
        elif "staleness" in rl_parts:
            demo_task = tasks.task_config(args.quick, tasks.DEMO_TASK)
            print(f"warm start of the demo task ({demo_task['warm_start']['steps']} supervised steps) ...", flush=True)
            demo_checkpoint = tasks.warm_checkpoint({**demo_task, "seed": args.warm_start_seed},
                                                    out / "checkpoint_demo", scratch=None)
    # --quick is a smoke test: its runs alike share one rollout server (runs.SharedServers)
    with runs.shared_servers() if args.quick else contextlib.nullcontext():
        for part in args.parts:
            t = time.perf_counter()
            print(f"[{part}]", flush=True)
            if part == "async":
                from areal_jax.bench import async_sync

                results[part] = async_sync.run(out, checkpoint, task, quick=args.quick, seed=args.seed,
                                               steps=args.steps, only=args.modes, n_seeds=args.seeds, done=done)
            elif part == "staleness":
                from areal_jax.bench import staleness

                results[part] = staleness.run(out, demo_checkpoint, demo_task, quick=args.quick, seed=args.seed)
            elif part == "interrupt":
                from areal_jax.bench import interrupt

                results[part] = interrupt.run(out, checkpoint, task, quick=args.quick, seed=args.seed, steps=args.steps,
                                              done=done)
            elif part == "components":
                from areal_jax.bench import components

                results[part] = components.run(out, quick=args.quick)
            results[part]["seconds"] = time.perf_counter() - t
            report.write_json(out, part, results[part])
    summary = {"parts": args.parts, "quick": args.quick, "seconds": time.perf_counter() - t0,
               "conditions": report.conditions(), "files": sorted(str(p) for p in out.glob("*.json"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    from areal_jax.bench.tables import markdown

    (out / "results.md").write_text(markdown(out))
    print(f"done in {summary['seconds']:.0f}s; results in {out}/", flush=True)
    return results
