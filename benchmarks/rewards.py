"""Reward pool throughput: rewards per second with N worker processes, for math-verify and for
sandboxed code (where the code sandbox runs: without one, code rewards refuse to run), beside
calling the same function inline; and the latency the pool adds per call.

    python benchmarks/rewards.py [--workers 2] [--calls 200] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from areal_jax.rewards import RewardConfig, RewardPool, get_reward_fn, isolation


def _frac(a: int, b: int) -> str:
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


MATH = [("The answer is \\boxed{" + _frac(i, i + 1) + "}.", {"answer": _frac(2 * i, 2 * i + 2)}) for i in range(1, 50)]
CODE = [("```python\na, b = map(int, input().split())\nprint(a + b)\n```",
         {"tests": [{"input": f"{i} {i + 1}", "output": str(2 * i + 1)}]}) for i in range(50)]


def _inline(name: str, cases: list, calls: int) -> tuple[float, float]:
    fn = get_reward_fn(name)
    lat = []
    t0 = time.perf_counter()
    for i in range(calls):
        c, f = cases[i % len(cases)]
        t = time.perf_counter()
        fn("q", c, **f)
        lat.append(time.perf_counter() - t)
    return calls / (time.perf_counter() - t0), statistics.median(lat)


async def _pooled(name: str, cases: list, calls: int, workers: int) -> tuple[float, float]:
    with RewardPool(RewardConfig(name=name, num_workers=workers, timeout_s=30)) as pool:
        await asyncio.gather(*(pool.score("q", c, f) for c, f in cases[:workers * 2]))  # warm the workers
        lat = []
        for c, f in cases[:20]:  # one at a time: the latency the pool adds
            t = time.perf_counter()
            await pool.score("q", c, f)
            lat.append(time.perf_counter() - t)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(pool.score("q", *cases[i % len(cases)]) for i in range(calls)))
        rate = calls / (time.perf_counter() - t0)
        assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
        return rate, statistics.median(lat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = {}
    parts = [("math", MATH, args.calls), ("code", CODE, max(20, args.calls // 4))]
    iso = isolation.detect()
    if iso.kind == "none":  # code rewards refuse to run unsandboxed, and are not timed so
        print(f"code rewards not measured: {iso.problem} (see BUILD.md, 'Code rewards')")
        parts.pop()
    for name, cases, calls in parts:
        inline_rate, inline_lat = _inline(name, cases, calls)
        pool_rate, pool_lat = asyncio.run(_pooled(name, cases, calls, args.workers))
        rows[name] = {"inline_per_s": inline_rate, "pool_per_s": pool_rate, "inline_latency_ms": 1e3 * inline_lat,
                      "pool_latency_ms": 1e3 * pool_lat, "added_latency_ms": 1e3 * (pool_lat - inline_lat),
                      "workers": args.workers, "calls": calls}
    print(f"{'reward':<6} {'inline/s':>9} {'pool/s':>8} {'inline ms':>10} {'pool ms':>8} {'added ms':>9}")
    for name, r in rows.items():
        print(f"{name:<6} {r['inline_per_s']:>9.1f} {r['pool_per_s']:>8.1f} {r['inline_latency_ms']:>10.2f} "
              f"{r['pool_latency_ms']:>8.2f} {r['added_latency_ms']:>9.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
