"""Long-tail decode: one decode step of 64 live answers, per-slot KV cache beside the paged pool.

Two batches of 64 answers: all at 100 tokens, and the long tail (one answer at 4,000 tokens, 63
at 100). The per-slot cache (``Decoder.decode``) attends every row up to a bucket of the longest
answer (the engine's default buckets for a 4,608-token context), so the long tail costs about
64 x 4,000; the paged pool (``Decoder.decode_paged``, pages of 16) reads each answer's own pages
through a ragged work list (padded by ``inference.pages.work_size``), so it costs the tokens live;
``fixed`` is the paged path as the engine calls it, the work list at a fixed length (64 full
contexts) read on device only up to the size that holds the live entries (one compiled step for
both batches).
The figure of merit is each path's long-tail step time over its own all-short step time (the
issue's goal: within 1.5x).

One step is the model's decode of one token per row with logits (no sampling), jitted, the cache
donated, timed after a warm-up; the four cases run in alternating rounds and each keeps its
median, so drift in machine speed hits all alike. A random model with ``--size``'s shapes
(``small``: 4 layers, hidden 256, 8 heads, 2 KV heads of 32; ``tiny``: the demo model's).

    python benchmarks/paged_decode.py [--size small|tiny] [--rounds 5] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.inference.config import default_kv_buckets
from areal_jax.inference.pages import PageAllocator, PageTable, paged_work, work_size
from areal_jax.inference.steps import bucket
from areal_jax.models.attention import PagedWork
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.tiny import TINY_SIZES

ROWS, SHORT, LONG, CONTEXT, PAGE = 64, 100, 4000, 4608, 16


def dense_case(model: Decoder, lengths: list[int]) -> Any:
    """A callable running one per-slot-cache decode step for answers of ``lengths``."""
    kv_len = bucket(max(lengths) + 1, default_kv_buckets(CONTEXT))
    step = jax.jit(lambda m, ids, pos, cache: m.decode(ids, pos, cache, kv_len=kv_len), donate_argnums=(3,))
    ids = jnp.ones((len(lengths), 1), jnp.int32)
    pos = jnp.asarray(lengths, jnp.int32)[:, None]
    state = {"cache": model.init_cache(len(lengths), CONTEXT)}

    def run() -> None:
        logits, state["cache"] = step(model, ids, pos, state["cache"])
        logits.block_until_ready()

    return run, {"kv_len": kv_len}


def paged_case(model: Decoder, lengths: list[int], fixed: bool = False) -> Any:
    """A callable running one paged decode step for answers of ``lengths``; ``fixed``: the work
    list at the fixed length of 64 full contexts with its live count (the engine's calls since
    the shapes are compiled at warm-up), read on device up to the size that holds the entries."""
    pool = PageAllocator(num_pages=1024, page_size=PAGE)
    tables = [PageTable(pool) for _ in lengths]
    for t, n in zip(tables, lengths, strict=True):
        t.reserve(n + 1)
    writes = [t.write_slots(n, n + 1) for t, n in zip(tables, lengths, strict=True)]
    wp = jnp.asarray(np.stack([w[0] for w in writes]))
    wo = jnp.asarray(np.stack([w[1] for w in writes]))
    entries = sum(pool.pages_for(n + 1) for n in lengths)
    size = len(lengths) * pool.pages_for(CONTEXT) if fixed else work_size(entries)
    work = PagedWork(*map(jnp.asarray, paged_work([t.pages for t in tables], [n + 1 for n in lengths], PAGE, size)),
                     live=jnp.int32(entries) if fixed else None)
    step = jax.jit(lambda m, ids, pos, cache, wp, wo, work: m.decode_paged(
        ids, pos, cache, write_pages=wp, write_offsets=wo, work=work), donate_argnums=(3,))
    ids = jnp.ones((len(lengths), 1), jnp.int32)
    pos = jnp.asarray(lengths, jnp.int32)[:, None]
    state = {"cache": model.init_paged_cache(pool.num_pages, PAGE)}

    def run() -> None:
        logits, state["cache"] = step(model, ids, pos, state["cache"], wp, wo, work)
        logits.block_until_ready()

    return run, {"work_entries": entries, "work_size": size, "pool_tokens": pool.max_total_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(TINY_SIZES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case per round")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()

    model = Decoder(ModelConfig(vocab_size=128, **TINY_SIZES[args.size]), rngs=nnx.Rngs(0))
    batches = {"short": [SHORT] * ROWS, "long_tail": [LONG] + [SHORT] * (ROWS - 1)}
    cases, meta = {}, {}
    for path, make in (("dense", dense_case), ("paged", paged_case),
                       ("fixed", lambda m, lengths: paged_case(m, lengths, fixed=True))):
        for name, lengths in batches.items():
            run, info = make(model, lengths)
            run()  # compile
            cases[path, name], meta[path, name] = run, info
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for key, run in cases.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[key].append((time.perf_counter() - t0) / args.steps)
    results = {"size": args.size, "rows": ROWS, "short": SHORT, "long": LONG, "page_size": PAGE,
               "backend": jax.default_backend()}
    for path in ("dense", "paged", "fixed"):
        ms = {name: 1000 * float(np.median(times[path, name])) for name in batches}
        results[path] = {"short_ms": ms["short"], "long_tail_ms": ms["long_tail"],
                         "long_tail_over_short": ms["long_tail"] / ms["short"],
                         **{f"{name}_{k}": v for name in batches for k, v in meta[path, name].items()}}
        print(f"{path:5}: {ms['short']:7.2f} ms a step at 64 x {SHORT}, {ms['long_tail']:7.2f} ms with one at {LONG} "
              f"({ms['long_tail'] / ms['short']:.2f}x)", flush=True)
    print(f"long tail, paged over dense: {results['paged']['long_tail_ms'] / results['dense']['long_tail_ms']:.2f}x; "
          f"all short, paged over dense: {results['paged']['short_ms'] / results['dense']['short_ms']:.2f}x; "
          f"fixed work lists over bucketed: {results['fixed']['short_ms'] / results['paged']['short_ms']:.2f}x "
          f"all short, {results['fixed']['long_tail_ms'] / results['paged']['long_tail_ms']:.2f}x long tail")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
