"""Decode throughput of the JAX engine beside Hugging Face ``transformers`` ``generate``.

Both run the same checkpoint in the same process on CPU: by default the demo model ("tiny": 2
layers, hidden 64, vocab 128), or with ``--size small`` a 2.3M-parameter one (4 layers, hidden
256) where the matmuls, not per-op overhead, set the pace. ``concurrency`` prompts of
``--prompt-len`` tokens each generate exactly ``--new-tokens`` tokens (eos ignored), greedy.
Throughput counts generated tokens over the wall time of the whole batch (prefill included),
after a warm-up run; the two sides run in alternating rounds and each keeps its best, so drift in
machine speed hits both alike. The engine's warm-up time (mostly compilation) is reported
separately. The engine runs with its default lane count (see ``EngineConfig.lanes``) unless
``--lanes`` says otherwise.

    python benchmarks/decode.py [--size tiny|small] [--out results.json]

``--length-mix`` measures something else: more requests than slots, with answer lengths from a
long-tailed distribution (most short, a few long), run with and without ending a decode chunk
where a request ends (``EngineConfig.end_chunk_at_finish``). It reports the slot-steps spent on
finished requests while others waited (the waste), decode calls and tokens/s.

    python benchmarks/decode.py --length-mix [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from areal_jax.inference import Engine, EngineConfig, GenerateOutput, GenerateRequest, SamplingParams
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint


def engine_run(engine: Engine, prompts: list[list[int]], new_tokens: int,
               outputs: list[GenerateOutput] | None = None) -> float:
    """Seconds to generate ``new_tokens`` for every prompt, all submitted at once (the answers are
    appended to ``outputs`` when one is given)."""
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    async def go() -> float:
        await engine.start()
        try:
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, sp)) for p in prompts))
            elapsed = time.perf_counter() - t0
        finally:
            await engine.stop()
        assert all(len(o.output_ids) == new_tokens for o in outs)
        if outputs is not None:
            outputs.extend(outs)
        return elapsed

    return asyncio.run(go())


def make_engine(ckpt: Path, prompts: list[list[int]], new_tokens: int, decode_steps: int,
                lanes: int | None = None, decode_unroll: int | None = None) -> Engine:
    model = load_pretrained(ckpt, **({} if decode_unroll is None else {"decode_unroll": decode_unroll}))
    cfg = EngineConfig(num_slots=len(prompts), max_seq_len=len(prompts[0]) + new_tokens + decode_steps,
                       max_prefill_batch=min(len(prompts), 64), decode_steps=decode_steps, lanes=lanes)
    return Engine(model, cfg)


def make_transformers_run(ckpt: Path, prompts: list[list[int]], new_tokens: int) -> Callable[[], float]:
    """A function that generates with ``transformers`` (torch CPU, 2 threads) and returns seconds."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n: int = new_tokens) -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
            elapsed = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + n
        return elapsed

    run(8)  # warm-up
    return run


def mix_round(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> dict:
    """One run of every request at once; the engine's counters over it."""
    before = dict(engine.stats)

    async def go() -> float:
        await engine.start()
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(engine.generate(GenerateRequest(p, SamplingParams(
                max_new_tokens=n, temperature=0.0, ignore_eos=True))) for p, n in zip(prompts, lengths, strict=True)))
            return time.perf_counter() - t0
        finally:
            await engine.stop()

    elapsed = asyncio.run(go())
    diff = {k: engine.stats[k] - before[k] for k in engine.stats}
    return {"seconds": elapsed, "tok_s": sum(lengths) / elapsed, "decode_calls": diff["decode_calls"],
            "prefill_calls": diff["prefill_calls"],
            "idle_slot_steps_while_waiting": diff["idle_slot_steps_while_waiting"],
            "decode_slot_steps": diff["decode_steps"] * engine.lane_slots}


def length_mix(ckpt: Path, requests: int, slots: int, decode_steps: int, rounds: int) -> list[dict]:
    """The long-tailed mix with and without ending chunks at a finish; best round of each."""
    rng = np.random.default_rng(0)
    lengths = np.clip((rng.pareto(1.2, requests) + 1) * 4, 1, 256).astype(int).tolist()
    prompts = rng.integers(4, 128, (requests, 16)).tolist()
    rows = []
    for end_at_finish in (False, True):
        cfg = EngineConfig(num_slots=slots, max_seq_len=16 + 256 + decode_steps, decode_steps=decode_steps,
                           end_chunk_at_finish=end_at_finish, seed=0)
        engine = Engine(load_pretrained(ckpt), cfg)

        mix_round(engine, prompts, lengths)  # compiles
        best = min((mix_round(engine, prompts, lengths) for _ in range(rounds)), key=lambda r: r["seconds"])
        rows.append({"end_chunk_at_finish": end_at_finish, "lanes": engine.num_lanes, **best})
        print(f"end_chunk_at_finish={end_at_finish!s:5}: {best['tok_s']:7.0f} tok/s, {best['decode_calls']} decode "
              f"and {best['prefill_calls']} prefill calls, {best['idle_slot_steps_while_waiting']} idle slot-steps "
              "while requests waited "
              f"(of {best['decode_slot_steps']} slot-steps)", flush=True)
    print(f"{requests} requests over {slots} slots, {sum(lengths)} tokens; lengths: median "
          f"{int(np.median(lengths))}, p90 {int(np.percentile(lengths, 90))}, max {max(lengths)}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--size", default="tiny", choices=["tiny", "small"],
                    help="checkpoint size: tiny is the demo model (0.08M parameters), small is 2.3M")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=8, help="tokens per compiled decode call")
    ap.add_argument("--lanes", type=int, default=None, help="engine lanes (default: the engine's own choice)")
    ap.add_argument("--decode-unroll", type=int, default=None,
                    help="ModelConfig.decode_unroll: decoder layers per iteration of the decode scan (default 1)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per side (best is kept)")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--length-mix", action="store_true",
                    help="long-tailed answer lengths, more requests than slots: the waste of finished slots")
    ap.add_argument("--requests", type=int, default=128, help="--length-mix: requests")
    ap.add_argument("--slots", type=int, default=16, help="--length-mix: KV slots")
    args = ap.parse_args()
    if args.length_mix:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = make_tiny_checkpoint(Path(tmp) / args.size, size=args.size)
            rows = length_mix(ckpt, args.requests, args.slots, args.decode_steps, args.rounds)
        if args.out:
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                           indent=2))
        return

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / args.size, size=args.size)
        rng = np.random.default_rng(0)
        for c in args.concurrency:
            prompts = rng.integers(4, 128, (c, args.prompt_len)).tolist()
            engine = make_engine(ckpt, prompts, args.new_tokens, args.decode_steps, args.lanes, args.decode_unroll)
            warmup = engine_run(engine, prompts, args.new_tokens)  # compiles every shape the timed runs meet
            hf_run = None if args.skip_transformers else make_transformers_run(ckpt, prompts, args.new_tokens)
            # This machine's speed drifts: alternate the two sides and keep each one's best round.
            ours, theirs = [], []
            for _ in range(args.rounds):
                ours.append(engine_run(engine, prompts, args.new_tokens))
                if hf_run is not None:
                    theirs.append(hf_run())
            tokens = c * args.new_tokens
            row = {"concurrency": c, "engine": {
                "tok_s": tokens / min(ours), "rounds_s": ours, "warmup_s": warmup,
                "compiled_shapes": engine.prefill_fn._cache_size() + engine.decode_fn._cache_size(),
                "lanes": engine.num_lanes}}
            if theirs:
                row["transformers"] = {"tok_s": tokens / min(theirs), "rounds_s": theirs}
                row["speedup"] = row["engine"]["tok_s"] / row["transformers"]["tok_s"]
            rows.append(row)
            hf = row.get("transformers", {}).get("tok_s", float("nan"))
            print(f"concurrency {c:3d}: engine {row['engine']['tok_s']:8.0f} tok/s "
                  f"({engine.num_lanes} lane(s), warm-up {row['engine']['warmup_s']:.1f} s)   "
                  f"transformers {hf:8.0f} tok/s   "
                  f"x{row.get('speedup', float('nan')):.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
