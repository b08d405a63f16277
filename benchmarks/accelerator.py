"""Decode and train throughput on JAX's default device against rooflines measured in the same run.

Meant for a GPU or TPU (it runs on CPU too, for a check of the script). The model is random,
shaped like a real one (``--model``: Qwen2.5-0.5B's shapes by default), so no download is needed.

- **Ceilings**, measured first: the best bfloat16 matmul FLOP/s (an ``n x n x n`` product) and the
  device-memory bandwidth of a large elementwise copy (bytes read plus written).
- **Attention check**: the packed training forward with the fused attention
  (``attention_impl='dot_product'``: cuDNN on GPU) against the model's own dense attention, same
  weights, same packed batch: the largest difference of token logprobs, so the speed figures below
  come from a path that computes the right thing.
- **Decode** (bfloat16 weights and cache, greedy, eos ignored): the engine generates
  ``--new-tokens`` for ``concurrency`` prompts of ``--prompt-len`` tokens. Decode tokens/s is
  taken from the difference of a full run and a run of a quarter of the tokens (same compiled
  shapes), so prefill drops out. Its bound is the memory roofline: each decode step must read
  every weight once and each sequence's KV cache up to its length, so at bandwidth ``B`` it
  makes at most ``concurrency * B / (weight_bytes + kv_bytes)`` tokens/s. ``--attention-backend``
  names one or more paged attention backends (``native``, the XLA gather path; ``fa``, the
  maintained kernel; ``auto``): each concurrency runs every one in turn on the same weights, so
  kernel and XLA figures come side by side from one process (each row says what ran).
- **Train**: ``Trainer.train_batch`` (proximal recompute, loss, gradient, AdamW update; float32
  master weights, bfloat16 compute) on packed long-tailed batches, with the dense attention and
  with the fused one. Model FLOPs count useful work only (as in ``train_step.py``: ``6 N`` per
  token plus causal attention, plus the recompute forward), against the bfloat16 matmul peak.

    python benchmarks/accelerator.py [--model qwen2.5-0.5b] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from decode import engine_run
from flax import nnx
from train_step import batch, best_seconds, matmul_peak, model_flops

from areal_jax.algo import AlgoConfig
from areal_jax.inference import Engine, EngineConfig, GenerateOutput
from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.logprobs import logprobs_from_logits
from areal_jax.trainer import TrainConfig, Trainer

MODELS: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B's config.json shapes (494M parameters, tied embeddings, q/k/v bias).
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6),
    # Qwen2.5-1.5B's.
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6),
    # Qwen2.5-7B's (7.6B parameters, untied embeddings, 4 KV heads).
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1e6),
    # A small one, for running the script on a CPU.
    "small": dict(model_type="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
}


def ceilings(matmul_n: int, copy_mib: int, reps: int) -> dict[str, float]:
    """Best bfloat16 matmul FLOP/s and copy bandwidth (bytes read + written per second)."""
    x = jnp.ones((copy_mib * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda v: v * 1.0001)
    t_copy = best_seconds(lambda: copy(x), reps)
    return {"bf16_matmul_tflops_per_s": matmul_peak(matmul_n, reps, jnp.bfloat16) / 1e12,
            "copy_gb_per_s": 2 * copy_mib * 2**20 / t_copy / 1e9, "matmul_n": matmul_n, "copy_mib": copy_mib}


def attention_check(shape: dict[str, Any], rows: int, row_len: int) -> dict[str, Any]:
    """Largest |logprob difference| between fused and dense attention on one packed batch (bfloat16)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, min(shape["vocab_size"], 1000), (rows, row_len))
    # Segments of random lengths packed into each row, the tail of a row left as padding (segment 0).
    seg = np.zeros((rows, row_len), np.int32)
    pos = np.zeros((rows, row_len), np.int32)
    for r in range(rows):
        at, s = 0, 1
        while at < row_len - row_len // 8:
            n = int(min(rng.integers(16, row_len // 2), row_len - row_len // 8 - at))
            seg[r, at:at + n], pos[r, at:at + n] = s, np.arange(n)
            at, s = at + n, s + 1
    out = {}
    for name, impl, dtype in (("dense", "dense", "bfloat16"), ("dot_product", "dot_product", "bfloat16"),
                              ("dense_float32", "dense", "float32")):
        cfg = ModelConfig(**shape, param_dtype="float32", dtype=dtype, attention_impl=impl)
        model = Decoder(cfg, rngs=nnx.Rngs(0))

        @jax.jit
        def lp(model: Decoder, ids: jax.Array, pos: jax.Array, seg: jax.Array) -> jax.Array:
            logits = model(ids, pos, seg)
            return logprobs_from_logits(logits[:, :-1], ids[:, 1:])

        out[name] = np.asarray(lp(model, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    # Only next tokens inside one segment are predictions the trainer uses.
    keep = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    result: dict[str, Any] = {"tokens": int(keep.sum()), "mean_abs_logprob": float(np.abs(out["dense"][keep]).mean())}
    # Fused against dense in bfloat16, and each against float32 dense (the size of bfloat16 rounding).
    for a, b in (("dot_product", "dense"), ("dense", "dense_float32"), ("dot_product", "dense_float32")):
        diff = np.abs(out[a] - out[b])[keep]
        result[f"{a}_vs_{b}"] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}
    return result


def decode(shape: dict[str, Any], concurrency: list[int], prompt_len: int, new_tokens: int, decode_steps: int,
           rounds: int, bandwidth: float, unroll: int = 1,
           backends: tuple[str, ...] = ("auto",), layouts: tuple[str, ...] = ("split",),
           on_row: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Decode rows, concurrency by concurrency, each backend in turn (see the module docstring);
    ``on_row`` gets the rows so far after each one (so a run cut short keeps what it measured)."""
    cfg = ModelConfig(**shape, param_dtype="bfloat16", dtype="bfloat16", decode_unroll=unroll,
                      fuse_projections=True)  # the serving layout (models.fused)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    weight_bytes = 2 * cfg.num_params()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # k and v, bfloat16
    short = max(decode_steps, new_tokens // 4)
    rows = []
    first: dict[int, tuple[str, list[GenerateOutput]]] = {}  # each concurrency's first backend's answers
    for c, backend, layout in ((c, b, u) for c in concurrency for b in backends for u in layouts):
        try:
            rows.append(_decode_row(model, c, backend, layout, prompt_len, new_tokens, decode_steps, rounds, bandwidth,
                                    short, weight_bytes, kv_per_token, first))
        except Exception as e:  # a kernel this device cannot run must not lose the other rows
            traceback.print_exc()
            rows.append({"concurrency": c, "attention_backend": backend, "layer_layout": layout,
                         "error": f"{type(e).__name__}: {e}"[:2000]})
        if on_row is not None:
            on_row(rows)
    return rows


def _decode_row(model: Decoder, c: int, backend: str, layout: str, prompt_len: int, new_tokens: int, decode_steps: int,
                rounds: int, bandwidth: float, short: int, weight_bytes: int, kv_per_token: int,
                first: dict[int, tuple[str, list[GenerateOutput]]]) -> dict[str, Any]:
    """One decode row (see ``decode``); the first backend run at ``c`` leaves its answers in
    ``first``, and each later one reports how far its greedy answers agree with them."""
    cfg = model.config
    prompts = np.random.default_rng(c).integers(4, min(cfg.vocab_size, 1000), (c, prompt_len)).tolist()
    max_len = prompt_len + new_tokens + decode_steps
    engine = Engine(model, EngineConfig(num_slots=c, max_seq_len=max_len, max_prefill_batch=min(c, 64),
                                        decode_steps=decode_steps, lanes=1, attention_backend=backend,
                                        layer_layout=layout),
                    eos_token_ids=[])
    ran = getattr(engine, "attention_backend", "slots")  # the slot cache has no paged attention
    try:
        t0 = time.perf_counter()
        answers: list[GenerateOutput] = []
        engine_run(engine, prompts, new_tokens, answers)  # compiles every shape the timed runs meet
        engine_run(engine, prompts, short)
        warmup = time.perf_counter() - t0
        full, part = [], []
        for _ in range(rounds):
            full.append(engine_run(engine, prompts, new_tokens))
            part.append(engine_run(engine, prompts, short))
    finally:
        del engine
    decode_s = min(full) - min(part)
    # A difference of two timings: NaN where the machine's noise exceeded it (raise --new-tokens).
    tokens_s = c * (new_tokens - short) / decode_s if decode_s > 0 else float("nan")
    mean_ctx = prompt_len + (short + new_tokens) / 2
    step_bytes = weight_bytes + c * kv_per_token * mean_ctx
    roofline = c * bandwidth / step_bytes
    row: dict[str, Any] = {
        "concurrency": c, "attention_backend": backend, "layer_layout": layout, "ran": ran,
        "decode_tokens_per_s": tokens_s,
        "end_to_end_tokens_per_s": c * new_tokens / min(full),
        "ms_per_decode_step": 1e3 * decode_s / (new_tokens - short), "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": tokens_s / roofline, "bytes_per_step": step_bytes,
        "warmup_s": warmup, "full_s": full, "short_s": part}
    agree = ""
    if c not in first:
        first[c] = (ran, answers)
    else:
        # Greedy answers of two attention paths: the same first token's logprob up to bfloat16
        # rounding, and the same tokens until a near-tie flips one (random weights make ties common).
        ref_ran, ref = first[c]
        same = [next((i for i, (a, b) in enumerate(zip(x.output_ids, y.output_ids, strict=True)) if a != b), new_tokens)
                for x, y in zip(answers, ref, strict=True)]
        row["agreement_with"] = {
            "ran": ref_ran, "first_logprob_max_abs_diff": float(max(
                abs(x.output_logprobs[0] - y.output_logprobs[0]) for x, y in zip(answers, ref, strict=True))),
            "mean_tokens_before_first_difference": float(np.mean(same)),
            "first_token_equal_fraction": float(np.mean([s > 0 for s in same]))}
        a = row["agreement_with"]
        agree = (f"; vs {ref_ran}: first-logprob diff {a['first_logprob_max_abs_diff']:.3f}, "
                 f"{a['mean_tokens_before_first_difference']:.0f} tokens agree on average")
    print(f"decode c={c:4d} {backend}->{ran} {layout}: {tokens_s:10,.0f} tok/s "
          f"({row['ms_per_decode_step']:.2f} ms/step), "
          f"roofline {roofline:10,.0f} -> {100 * row['fraction_of_roofline']:.1f}%; end to end "
          f"{row['end_to_end_tokens_per_s']:,.0f} tok/s; warm-up {warmup:.0f} s{agree}", flush=True)
    return row


def train(shape: dict[str, Any], impls: list[str], groups: int, group_size: int, max_answer: int, budget: int,
          batches: int, peak: float, compile_warmup: bool = False) -> list[dict[str, Any]]:
    rows = []
    for impl in impls:
        cfg = ModelConfig(**shape, attention_impl=impl)
        max_len = 96 + max_answer
        trainer = Trainer(Decoder(cfg, rngs=nnx.Rngs(0)), AlgoConfig(),
                          TrainConfig(lr=1e-6, micro_batch_tokens=budget, max_seq_len=max_len,
                                      compile_warmup=compile_warmup))
        rng = np.random.default_rng(0)
        data = [batch(rng, groups, group_size, max_answer) for _ in range(batches)]
        # With --compile-warmup, Trainer.warmup compiles every step shape first (as an RL run with
        # train.compile_warmup does), and after the first batch (which compiles the optimizer's
        # update, not warmed) the first pass must compile nothing.
        ahead = trainer.warmup() if compile_warmup else None
        t0 = time.perf_counter()
        first = [trainer.train_batch(b, 0) for b in data]  # compiles every bucket the timed pass meets
        warmup = time.perf_counter() - t0
        t0 = time.perf_counter()
        stats = [trainer.train_batch(b, 0) for b in data]
        jax.block_until_ready(trainer.policy.params)
        elapsed = time.perf_counter() - t0
        lengths = [len(t) for b in data for t in b]
        flops = model_flops(cfg, lengths, recompute=True)
        rows.append({"attention_impl": impl, "compute_dtype": trainer.train.resolved_compute_dtype(),
                     "tokens_per_s": sum(lengths) / elapsed, "model_tflops_per_s": flops / elapsed / 1e12,
                     "fraction_of_bf16_peak": flops / elapsed / peak, "seconds_per_batch": elapsed / batches,
                     "tokens_per_batch": sum(lengths) / batches, "mean_length": float(np.mean(lengths)),
                     "micro_batches_per_batch": float(np.mean([s["n_micro_batches"] for s in stats])),
                     "padding_efficiency": float(np.mean([s["padding_efficiency"] for s in stats])),
                     "finite_loss": bool(all(np.isfinite(s["loss"]) for s in stats)), "warmup_s": warmup,
                     "first_pass_compile_s": [float(s["compile_seconds"]) for s in first],
                     "compile_warmup": ahead})
        r = rows[-1]
        if ahead is not None:
            print(f"train {impl:>11}: compile warm-up {ahead['shapes']} shapes in {ahead['seconds']:.0f} s; the "
                  f"first pass's batches then compiled " + ", ".join(f"{x:.2f}" for x in r["first_pass_compile_s"])
                  + " s (the optimizer update is not warmed)", flush=True)
        print(f"train {impl:>11}: {r['tokens_per_s']:10,.0f} tok/s, {r['model_tflops_per_s']:.1f} TFLOP/s = "
              f"{100 * r['fraction_of_bf16_peak']:.1f}% of bf16 peak; {r['seconds_per_batch']:.2f} s/batch "
              f"({r['tokens_per_batch']:,.0f} tokens, {r['micro_batches_per_batch']:.1f} micro-batches); "
              f"warm-up {warmup:.0f} s", flush=True)
        del trainer
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--parts", default="ceilings,attention,decode,train")
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--copy-mib", type=int, default=2048)
    ap.add_argument("--attention-len", type=int, default=1024, help="packed row length of the attention check")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=16, help="tokens per compiled decode call")
    ap.add_argument("--attention-backend", nargs="+", default=["auto"], choices=["auto", "native", "fa"],
                    help="paged attention backends the decode part runs, side by side (e.g. native fa)")
    ap.add_argument("--layer-layout", nargs="+", default=["split"], choices=["split", "stacked"],
                    help="the engine's layer weights (EngineConfig.layer_layout), side by side (e.g. split stacked)")
    ap.add_argument("--decode-unroll", type=int, default=1, help="decoder layers per iteration of the decode scan")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--impls", nargs="+", default=["dense", "dot_product"], help="train attention implementations")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-answer", type=int, default=1024)
    ap.add_argument("--budget", type=int, default=16384, help="micro-batch token budget")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--compile-warmup", action="store_true",
                    help="train: Trainer.warmup() first (train.compile_warmup); report what the first pass compiled")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    shape = MODELS[args.model]
    dev = jax.devices()[0]
    result: dict[str, Any] = {
        "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__, "host": platform.node(),
        "model": args.model, "params": ModelConfig(**shape).num_params(), "args": vars(args) | {"out": str(args.out)}}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}; model {args.model}: "
          f"{result['params'] / 1e6:.0f}M parameters", flush=True)
    result["ceilings"] = ceilings(args.matmul_n, args.copy_mib, reps=10)
    c = result["ceilings"]
    print(f"bf16 matmul {c['bf16_matmul_tflops_per_s']:.0f} TFLOP/s; copy {c['copy_gb_per_s']:.0f} GB/s", flush=True)
    save()
    steps = {
        "attention_check": lambda: attention_check(shape, rows=4, row_len=args.attention_len),
        "decode": lambda: decode(shape, args.concurrency, args.prompt_len, args.new_tokens, args.decode_steps,
                                 args.rounds, c["copy_gb_per_s"] * 1e9, args.decode_unroll,
                                 tuple(args.attention_backend), tuple(args.layer_layout),
                                 lambda rows: (result.update(decode=rows), save())),
        "train": lambda: [row for impl in args.impls for row in train(
            shape, [impl], args.groups, args.group_size, args.max_answer, args.budget, args.batches,
            c["bf16_matmul_tflops_per_s"] * 1e12, args.compile_warmup)],
    }
    for name, fn in steps.items():
        if name.split("_")[0] not in parts:
            continue
        try:
            result[name] = fn()
        except Exception as e:  # one failing part (a kernel this device lacks) must not lose the others
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        save()
    if "attention_check" in result and "error" not in result["attention_check"]:
        a = result["attention_check"]
        print("packed forward, |logprob difference| max / mean: " + "; ".join(
            f"{k} {v['max_abs']:.4f} / {v['mean_abs']:.5f}" for k, v in a.items() if isinstance(v, dict)), flush=True)

if __name__ == "__main__":
    main()
