"""Train-step throughput on the tiny and small models with realistic packed batches.

Reports, per model size: tokens per second of ``Trainer.train_batch`` (proximal recompute
included), the model FLOP/s that implies and its fraction of this machine's float32 matmul peak
(measured in the same run with a large jitted matmul), and the time of one minibatch gradient in
three layouts of the same data: packed rows with full attention, packed rows with block-local
attention (``TrainConfig.max_seq_len``), and one sequence per row padded.

Model FLOPs count useful work only: ``6 * N * tokens`` for forward + backward (N = parameters
that take part in matmuls) plus causal attention ``3 * 4 * layers * heads * head_dim * n(n+1)/2``
per sequence of n tokens, plus the recompute forward (a third of both). Padding and the
full-row attention of packed rows are not counted, so they show up as a lower fraction of peak.

    python benchmarks/train_step.py [--sizes tiny small] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.data.packing import make_buckets
from areal_jax.data.trajectory import Trajectory
from areal_jax.models import Decoder, ModelConfig
from areal_jax.models.tiny import TINY_SIZES
from areal_jax.trainer import TrainConfig, Trainer, batching


def best_seconds(fn: Any, reps: int) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` (after one untimed call that compiles it)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t)
    return best


def matmul_peak(n: int = 2048, reps: int = 5, dtype: Any = jnp.float32) -> float:
    """Best FLOP/s of an n x n matmul in ``dtype``."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / best_seconds(lambda: f(a, b), reps)


def batch(rng: np.random.Generator, groups: int, group_size: int, max_answer: int) -> list[Trajectory]:
    """Prompts 16-96 tokens, answers long-tailed (lognormal, median ~max_answer/5), truncated."""
    out = []
    for g in range(groups):
        prompt = rng.integers(0, 128, int(rng.integers(16, 96)))
        for _ in range(group_size):
            a = int(min(rng.lognormal(np.log(max_answer / 5), 0.8) + 1, max_answer))
            out.append(Trajectory.from_prompt_and_answer(prompt, rng.integers(0, 128, a), -rng.uniform(3, 5, a), 0,
                                                         reward=float(rng.random()), group_id=g))
    return out


def model_flops(cfg: ModelConfig, lengths: list[int], recompute: bool) -> float:
    n_matmul = cfg.num_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    attn_fwd = sum(4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * (n + 1) / 2
                   for n in lengths)
    tokens = sum(lengths)
    passes = 3 + (1 if recompute else 0)  # forward + backward (2x), + recompute forward
    return passes * (2 * n_matmul * tokens + attn_fwd)


def attention_profile(cfg: ModelConfig, micro: dict, window: int, block: int, reps: int) -> dict:
    """What bounds the step: one decoder layer's attention, as the trainer runs it on packed rows
    (block-sparse over the rows' block pairs; ``block`` 0: every score in the window), against
    the same layer's weight matmuls, forward + backward each, on one packed micro-batch; and how
    many attention scores that computes against the ones causal attention within each sequence
    needs."""
    from areal_jax.data.packing import attention_block_pairs, pair_budget
    from areal_jax.models.attention import attend_packed_local, attend_packed_pairs

    seg = np.asarray(micro["segment_ids"])
    b, t = seg.shape
    lengths = [[int(n) for s, n in zip(*np.unique(row, return_counts=True), strict=True) if s > 0] for row in seg]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, cfg.num_attention_heads, cfg.head_dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, cfg.num_key_value_heads, cfg.head_dim)), jnp.float32)
            for _ in range(2))
    if block:
        bs = min(block, t)
        rows = [attention_block_pairs(n, t, bs) for n in lengths]
        pairs = np.zeros((b, pair_budget(max(len(r) for r in rows), t // bs), 2), np.int32)
        pairs[..., 1] = t // bs - 1
        for r, p in enumerate(rows):
            pairs[r, :len(p)] = p
        fn = partial(attend_packed_pairs, segment_ids=jnp.asarray(seg), pairs=jnp.asarray(pairs), block=bs)
        computed = pairs.shape[0] * pairs.shape[1] * bs * bs * cfg.num_attention_heads
    else:
        fn = partial(attend_packed_local, segment_ids=jnp.asarray(seg), window=window)
        bs = min(128, t)
        computed = b * t * min(t, (-(-(max(window, 1) - 1) // bs) + 1) * bs) * cfg.num_attention_heads
    attention = jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    x = jnp.asarray(rng.normal(size=(b * t, h)), jnp.float32)
    weights = [jnp.asarray(rng.normal(size=s), jnp.float32) * 0.02
               for s in ((h, qkv_out), (cfg.num_attention_heads * cfg.head_dim, h), (h, 2 * i), (i, h))]

    def layer_matmuls(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        a = x @ ws[0]
        o = a[:, :cfg.num_attention_heads * cfg.head_dim] @ ws[1]
        g = (x + o) @ ws[2]
        return ((g[:, :i] * g[:, i:]) @ ws[3]).sum()

    matmuls = jax.jit(jax.grad(layer_matmuls, argnums=(0, 1)))
    attention_s = _timed(lambda: jax.block_until_ready(attention(q, k, v)), reps)
    matmul_s = _timed(lambda: jax.block_until_ready(matmuls(x, weights)), reps)
    needed = sum(n * (n + 1) // 2 for row in lengths for n in row) * cfg.num_attention_heads
    return {"attention_s_per_layer": attention_s, "matmuls_s_per_layer": matmul_s,
            "attention_share": attention_s / (attention_s + matmul_s), "window": window, "block": block,
            "scores_computed": computed, "scores_needed": needed, "scores_computed_over_needed": computed / needed}


def _timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def run_size(size: str, peak: float, args: argparse.Namespace) -> dict:
    cfg = ModelConfig(vocab_size=128, tie_word_embeddings=True, **TINY_SIZES[size])
    buckets = make_buckets(128, 6)  # 128 ... 4096
    max_len = 96 + args.max_answer  # longest prompt + longest answer of `batch`
    full_attention = Trainer(Decoder(cfg, rngs=nnx.Rngs(0)), AlgoConfig(),
                             TrainConfig(lr=1e-5, micro_batch_tokens=args.budget, length_buckets=buckets))
    trainer = Trainer(Decoder(cfg, rngs=nnx.Rngs(0)), AlgoConfig(),
                      TrainConfig(lr=1e-5, micro_batch_tokens=args.budget, length_buckets=buckets,
                                  max_seq_len=max_len, attention_block=args.attention_block))
    rng = np.random.default_rng(0)
    batches = [batch(rng, args.groups, args.group_size, args.max_answer) for _ in range(args.batches)]
    for b in batches:  # compile every bucket the timed pass will meet
        trainer.train_batch(b, 0)
    stats = []
    start = time.perf_counter()
    for b in batches:
        stats.append(trainer.train_batch(b, 0))
    elapsed = time.perf_counter() - start
    lengths = [len(t) for b in batches for t in b]
    flops = model_flops(cfg, lengths, recompute=True)

    # Packed vs padded: one minibatch gradient + update on identical data.
    trajs = batches[0]
    lens = [len(t) for t in trajs]
    prepared = trainer.prepare_batch(trajs, 0)
    seqs = []
    for t, a in zip(trajs, prepared.advantages, strict=True):
        s = batching.shifted_fields(t)
        s["advantages"] = batching.shift_token_values(a)
        s["proximal_logprobs"] = s["behavior_logprobs"]
        seqs.append(s)
    idx = range(len(trajs))
    packed = [batching.pack_rows(seqs, p) for p in batching.plan_micro_batches(
        lens, idx, dp_groups=1, token_budget=args.budget, min_micro_batches=1, buckets=buckets)]
    padded = [batching.pack_rows(seqs, batching.padded_plan(lens, chunk, buckets))
              for chunk in np.array_split(np.arange(len(trajs)), args.padded_micro_batches)]
    layouts = {"packed_full_attention": (full_attention, packed), "packed_local_attention": (trainer, packed),
               "padded": (full_attention, padded)}

    def step(t: Trainer, micro: list[dict]) -> None:
        grads, _ = t.minibatch_grads(micro)
        jax.block_until_ready(grads)

    profile = attention_profile(cfg, packed[0], max_len, args.attention_block, args.reps)
    layout_stats = {}
    for name, (t, micro) in layouts.items():
        seconds = _timed(lambda t=t, micro=micro: step(t, micro), args.reps)
        processed = sum(m["input_ids"].size for m in micro)
        layout_stats[name] = {"seconds": seconds, "micro_batches": len(micro), "processed_tokens": processed,
                              "efficiency": sum(lens) / processed,
                              "tokens_per_s": sum(lens) / seconds}
    return {
        "size": size,
        "params": cfg.num_params(),
        "batches": args.batches,
        "trajectories_per_batch": args.groups * args.group_size,
        "mean_length": float(np.mean(lengths)),
        "tokens_per_s": sum(lengths) / elapsed,
        "model_tflops_per_s": flops / elapsed / 1e12,
        "fraction_of_matmul_peak": flops / elapsed / peak,
        "padding_efficiency": float(np.mean([s["padding_efficiency"] for s in stats])),
        "micro_batches_per_batch": float(np.mean([s["n_micro_batches"] for s in stats])),
        "grad_only": layout_stats,
        "profile": profile,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(TINY_SIZES))
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-answer", type=int, default=512)
    parser.add_argument("--budget", type=int, default=4096, help="micro-batch token budget per row")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--padded-micro-batches", type=int, default=4)
    parser.add_argument("--attention-block", type=int, default=TrainConfig().attention_block,
                        help="the trainer's block-sparse attention block (0: every score in the window)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    peak = matmul_peak()
    result = {"device": str(jax.devices()[0].device_kind), "matmul_peak_tflops_per_s": peak / 1e12,
              "sizes": [run_size(s, peak, args) for s in args.sizes]}
    text = json.dumps(result, indent=2)
    print(text)
    print(f"\nfloat32 matmul peak: {peak / 1e9:.0f} GFLOP/s")
    for r in result["sizes"]:
        print(f"{r['size']:>6}: {r['tokens_per_s']:,.0f} tok/s, {100 * r['fraction_of_matmul_peak']:.1f}% of peak; "
              "one minibatch gradient: " + ", ".join(
                  f"{k} {v['seconds']:.2f}s (eff {v['efficiency']:.2f})" for k, v in r["grad_only"].items()))
        pr = r["profile"]
        print(f"        one layer, forward + backward: attention {pr['attention_s_per_layer']:.3f}s, weight matmuls "
              f"{pr['matmuls_s_per_layer']:.3f}s (attention {100 * pr['attention_share']:.0f}%); attention scores "
              f"computed / needed: {pr['scores_computed_over_needed']:.1f}x "
              f"(window {pr['window']}, block {pr['block']})")
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
