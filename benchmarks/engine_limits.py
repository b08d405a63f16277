"""Engine limits: memory of a long-prompt prefill, chunked and not, and the cost of cancelling
many queued requests.

    python benchmarks/engine_limits.py prefill [--tokens 16384] [--size small] [--chunk 512]
    python benchmarks/engine_limits.py cancel [--requests 10000]

``prefill`` reports, for a chunked and an unchunked prefill of one prompt, the temporary memory
XLA plans for the largest prefill call (compiled, not run) and, for the runs it makes, the peak
resident memory of a fresh process that builds the engine and prefills the prompt (``--run`` picks
which: the unchunked run of 16k tokens on the small model needs tens of GiB). ``cancel`` queues
requests behind a paused engine and times cancelling them all (the event loop is blocked that
long). Both run against whatever ``areal_jax`` is importable, so the same command measures an
older checkout via ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _engine(ckpt: Path, tokens: int, chunk: int, **kw: object):  # noqa: ANN202
    from areal_jax.inference import Engine, EngineConfig
    from areal_jax.models import load_pretrained

    n = tokens + 64
    cfg = EngineConfig(num_slots=2, max_seq_len=n, max_prefill_batch=1, decode_steps=2, lanes=1,
                       chunked_prefill_size=chunk, prefill_buckets=(tokens, n),
                       kv_buckets=tuple(sorted({512, n // 4, n // 2, 3 * n // 4, n})), **kw)
    return Engine(load_pretrained(ckpt), cfg)


def planned_mib(ckpt: Path, tokens: int, chunk: int) -> float:
    """XLA's planned temporary memory of the biggest prefill call (compile only)."""
    from areal_jax.inference.steps import DEVICE_STOP_IDS

    engine = _engine(ckpt, tokens, chunk)
    cache = engine._lanes[0].cache  # noqa: SLF001
    t = chunk if chunk != -1 else tokens
    ids, rows = np.zeros((1, t), np.int32), np.array([tokens], np.int32)
    zero = np.zeros(1, np.int32)
    f32, u32 = np.ones(1, np.float32), np.zeros(1, np.uint32)
    compiled = engine.prefill_fn.lower(engine._state, cache, engine._lanes[0].slot_state, ids,  # noqa: SLF001
                                       np.int32(tokens - t), rows, zero, zero, f32, f32, np.full(1, -1, np.int32),
                                       u32, u32, zero, zero, np.full((1, DEVICE_STOP_IDS), -1, np.int32),
                                       kv_len=engine.max_seq_len).compile()
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def peak_rss_mib() -> float:
    """This process's peak resident memory: on Linux the high-water mark of its own memory map
    (``ru_maxrss`` also counts the peak of the parent it was started from by vfork and exec)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_prefill(ckpt: Path, tokens: int, chunk: int) -> dict:
    """In this (fresh) process: prefill one prompt; peak RSS before and after."""
    from areal_jax.inference import GenerateRequest, SamplingParams

    engine = _engine(ckpt, tokens, chunk)
    before = peak_rss_mib()
    prompt = np.random.default_rng(0).integers(4, 100, tokens).tolist()

    async def go() -> float:
        await engine.start()
        try:
            t0 = time.perf_counter()
            await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=1, temperature=0)))
            return time.perf_counter() - t0
        finally:
            await engine.stop()
    seconds = asyncio.run(go())
    peak = peak_rss_mib()
    return {"rss_before_mib": before, "peak_rss_mib": peak, "seconds": seconds}


def cancel_seconds(ckpt: Path, n: int) -> float:
    from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
    from areal_jax.models import load_pretrained

    engine = Engine(load_pretrained(ckpt), EngineConfig(num_slots=4, max_seq_len=64, lanes=1))
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)

    async def go() -> float:
        await engine.start()
        try:
            await engine.pause("in_place")
            tasks = [asyncio.create_task(engine.generate(GenerateRequest([1, 2, 3], sp))) for _ in range(n)]
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return time.perf_counter() - t0
        finally:
            await engine.resume()
            await engine.stop()
    return asyncio.run(go())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", choices=["prefill", "cancel", "_run"])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--size", default="small", choices=["tiny", "small"])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--run", default="chunked", choices=["chunked", "both", "none"],
                   help="which prefills to run for peak RSS")
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from areal_jax.models.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.ckpt) if args.ckpt else make_tiny_checkpoint(Path(tmp) / "m", size=args.size)
        if args.what == "_run":
            print(json.dumps(run_prefill(ckpt, args.tokens, args.chunk)))
        elif args.what == "cancel":
            print(json.dumps({"requests": args.requests, "cancel_seconds": cancel_seconds(ckpt, args.requests)}))
        else:
            out: dict = {"tokens": args.tokens, "size": args.size}
            for name, chunk in (("chunked", args.chunk), ("unchunked", -1)):
                row = {"chunk": chunk, "planned_temp_mib": planned_mib(ckpt, args.tokens, chunk)}
                if args.run == "both" or args.run == name:
                    proc = subprocess.run([sys.executable, __file__, "_run", "--tokens", str(args.tokens),
                                           "--chunk", str(chunk), "--ckpt", str(ckpt)], capture_output=True,
                                          text=True, env=dict(os.environ), check=True)
                    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                out[name] = row
            print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
