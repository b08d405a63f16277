"""Long-tail decode through the engine: a decode step of 64 live answers, one at 4,000 tokens and 63
at 100, against 64 at 100, on the paged engine and the slot engine; and how fast a server starts.

Each case starts an engine (greedy, ``ignore_eos``), submits its 64 requests (prompts of the
lengths above), waits until every prompt is prefilled, then times ``--calls`` decode calls of
``decode_steps`` tokens each (the wall time of the compiled call and its fetch, the host
bookkeeping excluded) and keeps the median call, so a call that compiles a new shape does not
count. The figure of merit is each engine's long-tail step time over its own all-short step
time (the issue's goal: within 1.5x). A random model with ``--size``'s shapes.

``--arrival`` times the paged engine's answers while a long prompt arrives: ``--answers`` (32)
answers decode (100-token prompts) when a 4,000-token prompt is submitted, prefilled in chunks of
``--chunk`` (512) tokens, with mixed steps (each chunk and ``decode_steps`` tokens of every
answer in one call) and on the alternating path (a prefill call per chunk, then a decode call of
``decode_steps``). Per mode it reports, over the window from the prompt's submission to its first
token: the largest gap between two token arrivals of
one answer, the answers' tokens per second and the device calls. One engine runs both modes in
turn (fresh answers and a new prompt of the same length each time): one arrival of each compiles
the shapes, then ``--repeats`` of each, alternating, are measured and their medians reported (the
JSON has every run, and how many of their calls compiled a new shape).

``--startup`` also starts ``areal-jax serve`` on a tiny checkpoint with each cache and reports the
step shapes its warm-up compiled and the seconds from launch to the first /generate reply.

    python benchmarks/long_tail_engine.py [--size small|tiny] [--calls 20] [--startup] [--out r.json]
    python benchmarks/long_tail_engine.py --arrival [--answers 32] [--chunk 512] [--repeats 3] [--skip-long-tail]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.tiny import TINY_SIZES

ROWS, SHORT, LONG, CONTEXT = 64, 100, 4000, 4608


async def _step_ms(engine: Engine, lengths: list[int], calls: int) -> dict:
    await engine.start()
    try:
        sp = SamplingParams(max_new_tokens=CONTEXT - max(lengths) - 1, temperature=0, ignore_eos=True)
        tasks = [asyncio.create_task(engine.generate(GenerateRequest([4 + (i + j) % 100 for j in range(n)], sp)))
                 for i, n in enumerate(lengths)]
        while engine.num_waiting or engine.stats["prompt_tokens"] < sum(lengths):
            await asyncio.sleep(0.05)  # every prompt admitted
        settle = engine.stats["decode_calls"] + 8  # and prefilled (the paged engine: 4 chunks between decodes)
        while engine.stats["decode_calls"] < settle:
            await asyncio.sleep(0.01)
        times: list[float] = []
        timed = engine._timed  # noqa: SLF001 - each decode call's wall time, compiles included

        async def timing(stat: str, fn: object, *args: object, **kwargs: object) -> object:
            t = time.perf_counter()
            out = await timed(stat, fn, *args, **kwargs)
            if stat == "decode_seconds":
                times.append(time.perf_counter() - t)
            return out

        engine._timed = timing  # noqa: SLF001
        c0 = engine.stats["decode_steps"]
        while len(times) < calls:
            await asyncio.sleep(0.01)
        steps = engine.stats["decode_steps"] - c0
        await engine.abort(abort_all=True)
        await asyncio.gather(*tasks)
        # the median call: a call that compiled a new shape (a work list grown past its bucket) is an outlier
        per_step = engine.cfg.decode_steps
        return {"step_ms": 1000 * float(np.median(times)) / per_step, "calls": len(times), "steps": steps,
                "mean_step_ms_with_compiles": 1000 * sum(times) / max(steps, 1)}
    finally:
        await engine.stop()


def long_tail(size: str, calls: int) -> dict:
    model = Decoder(ModelConfig(vocab_size=128, max_position_embeddings=CONTEXT, **TINY_SIZES[size]),
                    rngs=nnx.Rngs(0))
    batches = {"short": [SHORT] * ROWS, "long_tail": [LONG] + [SHORT] * (ROWS - 1)}
    out: dict = {}
    for kv in ("paged", "slots"):
        cfg = EngineConfig(num_slots=ROWS, max_seq_len=CONTEXT, kv_cache=kv, page_size=16, lanes=1,
                           max_total_tokens=ROWS * 512 + CONTEXT if kv == "paged" else None, seed=0)
        out[kv] = {}
        for name, lengths in batches.items():
            engine = Engine(model, cfg)
            out[kv][name] = asyncio.run(_step_ms(engine, lengths, calls))
            print(f"{kv:5} {name:9}: {out[kv][name]['step_ms']:7.2f} ms a decode step", flush=True)
        out[kv]["long_tail_over_short"] = out[kv]["long_tail"]["step_ms"] / out[kv]["short"]["step_ms"]
        print(f"{kv:5} long tail over short: {out[kv]['long_tail_over_short']:.2f}x", flush=True)
    return out


async def _arrival(engine: Engine, answers: int, repeats: int) -> dict:
    """``--arrival`` (see the module docstring): arrivals alternate between mixed steps and the
    alternating path on one engine, ``repeats`` measured of each after one of each compiles."""
    fns = (engine.mixed_fn, engine.decode_fn, engine.prefill_fn)
    arrivals: dict[int, list[tuple[float, int]]] = {}
    calls: list[tuple[str, float, float, bool]] = []
    notify, timed = engine._notify, engine._timed  # noqa: SLF001 - token arrivals and device calls

    def noting(seq: object) -> None:
        arrivals.setdefault(seq.stream_id, []).append((time.perf_counter(), len(seq.out_ids)))
        notify(seq)

    async def timing(stat: str, fn: object, *args: object, **kwargs: object) -> object:
        before, t = sum(f._cache_size() for f in fns), time.perf_counter()  # noqa: SLF001
        out = await timed(stat, fn, *args, **kwargs)
        calls.append((stat, t, time.perf_counter(), sum(f._cache_size() for f in fns) > before))  # noqa: SLF001
        return out

    engine._notify, engine._timed = noting, timing  # noqa: SLF001
    runs: dict[str, list[dict]] = {"mixed": [], "alternating": []}
    await engine.start()
    try:
        for k in range(2 * (repeats + 1)):
            mode = ("mixed", "alternating")[k % 2]
            engine.mixed_chunk = mode == "mixed"
            # fresh answers each time, so each arrival meets answers of the same lengths
            arrivals.clear()
            sp = SamplingParams(max_new_tokens=CONTEXT - 2 * SHORT, temperature=0, ignore_eos=True)
            tasks = [asyncio.create_task(engine.generate(
                GenerateRequest([4 + (i + j) % 100 for j in range(SHORT)], sp))) for i in range(answers)]
            while len(arrivals) < answers or engine.num_waiting:
                await asyncio.sleep(0.01)  # every answer has a token
            answer_ids = set(arrivals)
            ncalls, t0 = len(calls), time.perf_counter()
            one = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
            await engine.generate(GenerateRequest([4 + (k * 7 + 3 * j) % 120 for j in range(LONG)], one))
            result = _window(arrivals, answer_ids, calls[ncalls:], t0, time.perf_counter())
            await engine.abort(abort_all=True)
            await asyncio.gather(*tasks)
            if k >= 2:  # the first of each mode compiles its shapes
                runs[mode].append(result)
    finally:
        await engine.stop()
    out: dict = {}
    for mode, rs in runs.items():
        out[mode] = {key: float(np.median([r[key] for r in rs]))
                     for key in ("max_gap_ms", "median_gap_ms", "answer_tokens_per_s", "window_s")}
        out[mode].update(calls=rs[0]["calls"], compiling_calls=sum(r["compiling_calls"] for r in rs), runs=rs)
    return out


def _window(arrivals: dict, answer_ids: set, calls: list, t0: float, t1: float) -> dict:
    """The answers' token arrivals and the device calls from ``t0`` (the prompt's submission) to
    ``t1`` (its first token)."""
    window = [c for c in calls if c[1] < t1]
    compiled = [(a, b) for _, a, b, new in window if new]
    gaps, tokens = [], 0
    for sid in answer_ids:
        # the answer's last arrival before the prompt came, then each one until its first token
        points = [p for p in arrivals[sid] if p[0] < t0][-1:] + [p for p in arrivals[sid] if t0 <= p[0] <= t1]
        for (ta, na), (tb, nb) in zip(points, points[1:], strict=False):
            gaps.append(tb - ta)
            tokens += nb - na
    kinds = [stat.removesuffix("_seconds") for stat, *_ in window]
    return {"window_s": t1 - t0, "answer_tokens": tokens, "answer_tokens_per_s": tokens / (t1 - t0),
            "max_gap_ms": 1000 * max(gaps), "median_gap_ms": 1000 * float(np.median(gaps)),
            "compiling_calls": len(compiled), "calls": {k: kinds.count(k) for k in sorted(set(kinds))}}


def arrival(size: str, answers: int, chunk: int, repeats: int) -> dict:
    """``--arrival``: mixed steps against the alternating path, side by side on one engine."""
    model = Decoder(ModelConfig(vocab_size=128, max_position_embeddings=CONTEXT, **TINY_SIZES[size]),
                    rngs=nnx.Rngs(0))
    cfg = EngineConfig(num_slots=answers + 1, max_seq_len=CONTEXT, kv_cache="paged", page_size=16, lanes=1,
                       max_total_tokens=(answers + 2) * 256 + 2 * CONTEXT, chunked_prefill_size=chunk, seed=0)
    out: dict = {"answers": answers, "chunk": chunk, "decode_steps": cfg.decode_steps, "repeats": repeats}
    out.update(asyncio.run(_arrival(Engine(model, cfg), answers, repeats)))
    for mode in ("mixed", "alternating"):
        r = out[mode]
        print(f"{mode:11}: largest gap {r['max_gap_ms']:7.1f} ms (median {r['median_gap_ms']:6.1f}), "
              f"{r['answer_tokens_per_s']:7.1f} answer tok/s over {r['window_s']:.2f} s, calls {r['calls']}, "
              f"medians of {repeats}; {r['compiling_calls']} calls compiled", flush=True)
    out["max_gap_alternating_over_mixed"] = out["alternating"]["max_gap_ms"] / out["mixed"]["max_gap_ms"]
    return out


def startup(kv: str) -> dict:
    """Seconds from launching ``areal-jax serve`` (tiny checkpoint, default flags) to its first
    /generate reply, and the step shapes its warm-up compiled."""
    from areal_jax.models.tiny import make_tiny_checkpoint
    from tests.ports import free_port

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_checkpoint(Path(tmp) / "tiny", model_type="qwen2", size="tiny")
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": ""}
        log = Path(tmp) / "serve.log"
        t0 = time.perf_counter()
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", str(model_dir),
                                     "--port", str(port), "--kv-cache", kv, "--context-length", "1024"],
                                    env=env, stdout=f, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/generate"
        body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}).encode()
        try:
            while True:
                assert proc.poll() is None, log.read_text()[-2000:]
                try:
                    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                    with urllib.request.urlopen(req, timeout=600) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.2)
            seconds = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        shapes = re.search(r"compiling (\d+) step shapes", log.read_text())
    return {"first_generate_s": seconds, "warmup_shapes": int(shapes.group(1)) if shapes else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(TINY_SIZES))
    ap.add_argument("--calls", type=int, default=20, help="decode calls timed per case")
    ap.add_argument("--startup", action="store_true", help="also time a server's start (both caches)")
    ap.add_argument("--arrival", action="store_true", help="also time answers while a long prompt arrives")
    ap.add_argument("--answers", type=int, default=32, help="--arrival: answers decoding")
    ap.add_argument("--chunk", type=int, default=512, help="--arrival: --chunked-prefill-size")
    ap.add_argument("--repeats", type=int, default=3, help="--arrival: measured arrivals of each mode")
    ap.add_argument("--skip-long-tail", action="store_true", help="skip the long-tail decode step comparison")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    results: dict = {"size": args.size, "rows": ROWS, "short": SHORT, "long": LONG, "context": CONTEXT,
                     "backend": jax.default_backend(), "cpus": os.cpu_count()}
    if not args.skip_long_tail:
        results["engine"] = long_tail(args.size, args.calls)
    if args.arrival:
        results["arrival"] = arrival(args.size, args.answers, args.chunk, args.repeats)
    if args.startup:
        results["startup"] = {kv: startup(kv) for kv in ("paged", "slots")}
        for kv, r in results["startup"].items():
            print(f"{kv:5} server: {r['warmup_shapes']} warm-up shapes, first /generate after "
                  f"{r['first_generate_s']:.1f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
