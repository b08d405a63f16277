"""Packing efficiency on a long-tailed RL length distribution: packed + bucketed vs pad-to-max.

Efficiency is real tokens / processed tokens. Packed: each micro-batch is processed at its
bucketed length. Pad-to-max: every sequence is padded to the longest one in the batch.

    python benchmarks/packing.py [--seed 0] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from areal_jax.data.packing import DEFAULT_BUCKET_BASE, bucket_length, make_buckets, pack_first_fit_decreasing


def sample_lengths(rng: np.random.Generator, n: int, max_new_tokens: int) -> np.ndarray:
    """Prompt plus answer lengths; answers are lognormal (median ~1.1k tokens) and truncated."""
    prompts = rng.integers(64, 512, n)
    answers = np.minimum(rng.lognormal(mean=7.0, sigma=0.9, size=n).astype(int) + 1, max_new_tokens)
    return prompts + answers


def run(seed: int, batch_size: int, max_new_tokens: int, token_budget: int) -> dict:
    # Powers of two from the default base up to the first one that holds a full micro-batch.
    count = 1
    while DEFAULT_BUCKET_BASE * 2 ** (count - 1) < token_budget:
        count += 1
    buckets = make_buckets(DEFAULT_BUCKET_BASE, count)
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(rng, batch_size, max_new_tokens)
    real = int(lengths.sum())

    start = time.perf_counter()
    bins = pack_first_fit_decreasing(lengths.tolist(), token_budget)
    pack_seconds = time.perf_counter() - start
    processed = sum(bucket_length(int(lengths[b].sum()), buckets) for b in bins)
    pad_to_max = batch_size * int(lengths.max())
    return {
        "seed": seed,
        "batch_size": batch_size,
        "max_new_tokens": max_new_tokens,
        "token_budget": token_budget,
        "buckets": list(buckets),
        "real_tokens": real,
        "mean_length": float(lengths.mean()),
        "max_length": int(lengths.max()),
        "packed_processed_tokens": int(processed),
        "packed_efficiency": real / processed,
        "packed_micro_batches": len(bins),
        "pack_seconds": pack_seconds,
        "pad_to_max_processed_tokens": pad_to_max,
        "pad_to_max_efficiency": real / pad_to_max,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=512, help="sequences per training batch")
    parser.add_argument("--max-new-tokens", type=int, default=8192)
    parser.add_argument("--token-budget", type=int, default=32768, help="tokens per micro-batch")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()

    result = run(args.seed, args.batch_size, args.max_new_tokens, args.token_budget)
    print(
        f"{result['batch_size']} sequences, {result['real_tokens']} real tokens "
        f"(mean {result['mean_length']:.0f}, max {result['max_length']})"
    )
    print(
        f"first-fit-decreasing + buckets: efficiency {result['packed_efficiency']:.4f}, "
        f"{result['packed_micro_batches']} micro-batches, packed in {result['pack_seconds'] * 1e3:.1f} ms"
    )
    print(f"pad every sequence to the batch max: efficiency {result['pad_to_max_efficiency']:.4f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
