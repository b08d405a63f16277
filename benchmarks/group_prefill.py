"""GRPO group rounds through the engine in-process, counting the device calls and tokens that prefill costs.

The long-tail bench's warm-started model and server settings (128 running requests, context 512;
the engine's defaults otherwise) take rounds of ``--groups`` groups of ``--group-size`` answers to
one prompt of the bench's task, all submitted at once, in these kinds:

- ``fresh``: each answer generates ``--new-tokens`` tokens (EOS ignored);
- ``resend``: each answer of a fresh round is cut at a random token and sent again as its prompt
  plus the tokens so far, as the rollout client does after a weight update aborted it (AReaL with
  SGLang), and generates ``--new-tokens`` more;
- ``turn``: each answer of a fresh round is sent again whole, with 12 tokens of a tool's reply
  after it, as an agent's next turn, and generates ``--new-tokens`` more (what the prefix cache is
  for: the first turn's pages are read, not prefilled again).

Each variant (``--variants``: ``paged``, ``slots``, and ``paged@DIR`` for another checkout's code)
runs in its own worker process that keeps one warm engine; the rounds alternate between the
workers, so the machine's load drifts over all of them alike. Reported per variant: median round
seconds, and per round the device calls (prefill, mixed, decode), the prefilled tokens (real and
padded), the prompt tokens shared, and the share of the engine's busy seconds spent in calls that
prefill (prefill and mixed calls).

    python benchmarks/group_prefill.py [--rounds 5] [--variants paged,slots,paged@../main] [--out f.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

COUNTERS = ("prefill_calls", "mixed_calls", "decode_calls", "prefill_tokens", "prefill_padded_tokens",
            "shared_prompt_tokens", "prompt_tokens", "prefill_seconds", "mixed_seconds", "decode_seconds")


def _worker(kv_cache: str, args: argparse.Namespace) -> None:
    """Serve rounds on stdin (``fresh`` / ``resend`` / ``quit``), one JSON line each on stdout."""
    from areal_jax.bench import tasks
    from areal_jax.data import load_prompts
    from areal_jax.data.datasets import DatasetConfig
    from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
    from areal_jax.models import load_pretrained, load_tokenizer

    model_dir = tasks.SHIPPED_WARM_STARTS / "long_tail"
    cfg = tasks.task_config(False, tasks.LONG_TAIL_TASK)
    data = load_prompts(DatasetConfig(**{**cfg["data"], "eval_size": 10}), load_tokenizer(model_dir))
    prompts = [list(r.prompt_ids) for r in data.train_rows]
    model = load_pretrained(model_dir)
    engine = Engine(model, EngineConfig(num_slots=128, max_seq_len=512, seed=0, kv_cache=kv_cache),
                    eos_token_ids=model.config.eos_token_ids)
    rng = np.random.default_rng(0)

    def sampling(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True)

    async def main() -> None:
        if hasattr(engine, "warmup"):  # the paged engine compiles its call shapes ahead, as a server does
            engine.warmup()
        await engine.start()
        loop = asyncio.get_running_loop()
        k = 0
        try:
            while True:
                line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
                if line in ("", "quit"):
                    return
                group = [prompts[(k + g) % len(prompts)] for g in range(args.groups)]
                k += args.groups
                reqs = [GenerateRequest(p, sampling(args.new_tokens)) for p in group for _ in range(args.group_size)]
                if line == "resend":  # answers cut at a random token, sent again with their tokens so far
                    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
                    reqs = [GenerateRequest(r.input_ids + o.output_ids[:int(rng.integers(1, len(o.output_ids)))],
                                            sampling(args.new_tokens)) for r, o in zip(reqs, outs, strict=True)]
                elif line == "turn":  # an agent's next turn: prompt, the whole answer, a tool's reply
                    outs = await asyncio.gather(*(engine.generate(r) for r in reqs))
                    reqs = [GenerateRequest(r.input_ids + o.output_ids + [int(t) for t in rng.integers(3, 100, 12)],
                                            sampling(args.new_tokens)) for r, o in zip(reqs, outs, strict=True)]
                before = {c: engine.stats.get(c, 0) for c in COUNTERS}
                t0 = time.perf_counter()
                await asyncio.gather(*(engine.generate(r) for r in reqs))
                wall = time.perf_counter() - t0
                delta = {c: engine.stats.get(c, 0) - before[c] for c in COUNTERS}
                shapes = len(getattr(engine, "compiled_shapes", ()))
                print(json.dumps({"kind": line, "wall_s": wall, "compiled_shapes": shapes, **delta}), flush=True)
        finally:
            await engine.stop()

    asyncio.run(main())


def _start(variant: str, args: argparse.Namespace) -> subprocess.Popen:
    kv, _, tree = variant.partition("@")
    root = Path(tree).resolve() if tree else Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kv, "--groups", str(args.groups),
           "--group-size", str(args.group_size), "--new-tokens", str(args.new_tokens)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[1])


def _ask(proc: subprocess.Popen, kind: str) -> dict[str, Any]:
    proc.stdin.write(kind + "\n")
    proc.stdin.flush()
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({proc.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="paged,slots")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--kinds", default="fresh,resend")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args)
        return
    variants = args.variants.split(",")
    procs = {v: _start(v, args) for v in variants}
    kinds = args.kinds.split(",")
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {v: {k: [] for k in kinds} for v in variants}
    load = []
    try:
        for v in variants:  # compile outside the timing
            for k in kinds:
                _ask(procs[v], k)
                _ask(procs[v], k)
        for r in range(args.rounds):
            for k in kinds:
                for v in (variants if r % 2 == 0 else variants[::-1]):
                    rows[v][k].append(_ask(procs[v], k))
            load.append(os.getloadavg()[0])
    finally:
        for p in procs.values():
            p.stdin.write("quit\n")
            p.stdin.flush()
            p.wait()
    summary = {}
    for v in variants:
        for k in kinds:
            rs = rows[v][k]
            med = lambda key, rs=rs: float(np.median([x[key] for x in rs]))  # noqa: E731
            busy = [x["prefill_seconds"] + x["mixed_seconds"] + x["decode_seconds"] for x in rs]
            share = float(np.median([(x["prefill_seconds"] + x["mixed_seconds"]) / b
                                     for x, b in zip(rs, busy, strict=True) if b > 0]))
            summary[f"{v} {k}"] = s = {"round_s": med("wall_s"), "prefill_share": share,
                                        **{c: med(c) for c in COUNTERS if "seconds" not in c}}
            print(f"{v:>24s} {k:6s}: round {s['round_s']:.3f} s, prefill share {share:.0%}, calls prefill "
                  f"{s['prefill_calls']:.0f} mixed {s['mixed_calls']:.0f} decode {s['decode_calls']:.0f}, prefilled "
                  f"{s['prefill_tokens']:.0f} tokens ({s['prefill_padded_tokens']:.0f} padded), shared "
                  f"{s['shared_prompt_tokens']:.0f} of {s['prompt_tokens']:.0f}; shapes {rs[0]['compiled_shapes']}"
                  f"->{rs[-1]['compiled_shapes']}")
    print(f"load average (1 min) over the rounds: {min(load):.1f}-{max(load):.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "load_average": load,
                                              "summary": summary, "rounds": rows}, indent=1))


if __name__ == "__main__":
    main()
