"""Kernels per decoder layer of a decode step, and the step's time, with separate and with fused
projections (``ModelConfig.fuse_projections``: q/k/v as one matmul, gate/up as one).

The decode step (``Decoder.decode``, one token for each of ``--rows`` rows against a KV cache of
``--kv-len`` positions) is lowered and compiled for the CPU; the decoder layers run as one scan,
so its loop body is one layer. Counted there: the operations XLA launches per layer (fusions,
matmuls, scatters, copies, ...: every instruction of the loop body but parameters, tuples,
constants and bitcasts), the matmuls among them (``dot`` ops, also those inside fusions), and
the slices XLA copies out before a matmul reads them (each layer's weights out of the stacked
parameters, the cache's live positions).
Then each variant's step is timed in alternating rounds in one process (the median of each;
the two models share every weight but the fused ones), for the demo model ("tiny") and a
random model with Qwen2.5-0.5B's shapes ("0.5b"), float32.

    python benchmarks/decode_kernels.py [--sizes tiny,0.5b] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models import Decoder, ModelConfig
from areal_jax.models.fused import fuse_projections

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # Qwen2.5-0.5B's shapes (random weights).
    "0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                 tie_word_embeddings=True, rope_theta=1e6),
}

_SKIP = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*[^=]*?\s([\w\-]+)\((.*)$")


def _computations(hlo: str) -> dict[str, list[str]]:
    """HLO module text -> computation name -> its instruction lines."""
    out: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            out[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and line.strip():
            out[name].append(line)
    return out


def _opcode(line: str) -> str | None:
    m = _INSTR.match(line)
    return m.group(1) if m else None


def layer_kernels(hlo: str) -> dict[str, Any]:
    """Per layer (the scan's loop body): launched operations by opcode, and matmuls (also inside
    fusions). The body is the largest while-loop body of the module (the scan over layers)."""
    comps = _computations(hlo)
    bodies = [m.group(1) for lines in comps.values() for line in lines
              for m in [re.search(r"body=%?([\w.\-]+)", line)] if m]
    body = max(bodies, key=lambda b: len(comps.get(b, [])))

    def dots(name: str, seen: set[str]) -> int:
        n = 0
        for line in comps.get(name, []):
            if _opcode(line) == "dot":
                n += 1
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                if callee not in seen:
                    seen.add(callee)
                    n += dots(callee, seen)
        return n

    ops: dict[str, int] = {}
    for line in comps[body]:
        op = _opcode(line)
        if op and op not in _SKIP:
            ops[op] = ops.get(op, 0) + 1
    # Slices of the stacked weights and of the cache that XLA materialises as copies (a fusion
    # named after its dynamic-slice root) before the matmuls read them.
    slices = sum(1 for line in comps[body] if re.match(r"\s*%dynamic-slice[\w.\-]* = ", line))
    return {"launched": sum(ops.values()), "by_opcode": dict(sorted(ops.items())), "matmuls": dots(body, {body}),
            "slice_copies": slices}


def step_fn() -> Any:
    @jax.jit
    def step(model: Decoder, ids: jax.Array, positions: jax.Array, cache: Any) -> Any:
        logits, cache = model.decode(ids, positions, cache, kv_len=cache.max_len)
        return jnp.argmax(logits[:, -1], -1), cache

    return step


def measure(size: str, rows: int, kv_len: int, rounds: int, steps: int) -> dict[str, Any]:
    cfg = ModelConfig(**SIZES[size])
    separate = Decoder(cfg, rngs=nnx.Rngs(0))
    models = {"separate": separate, "fused": fuse_projections(separate)}
    ids = jnp.ones((rows, 1), jnp.int32)
    positions = jnp.full((rows, 1), kv_len // 2, jnp.int32)
    out: dict[str, Any] = {"size": size, "rows": rows, "kv_len": kv_len, "params": cfg.num_params()}
    runs: dict[str, Any] = {}
    for name, model in models.items():
        cache = model.init_cache(rows, kv_len)
        step = step_fn()
        hlo = step.lower(model, ids, positions, cache).compile().as_text()
        out[name] = {"per_layer": layer_kernels(hlo)}
        jax.block_until_ready(step(model, ids, positions, cache))  # compiled and warm
        runs[name] = (step, model, cache)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):  # alternating, so drift in machine speed hits both alike
        for name, (step, model, cache) in runs.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                tok, cache = step(model, ids, positions, cache)
            jax.block_until_ready(tok)
            times[name].append((time.perf_counter() - t0) / steps)
            runs[name] = (step, model, cache)
    for name in models:
        out[name]["step_ms"] = round(1e3 * statistics.median(times[name]), 3)
    out["fused_speedup"] = round(out["separate"]["step_ms"] / out["fused"]["step_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,0.5b")
    ap.add_argument("--rows", type=int, default=8, help="decode rows (answers) per step")
    ap.add_argument("--kv-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--out")
    args = ap.parse_args()
    results = [measure(s, args.rows, args.kv_len, args.rounds, args.steps) for s in args.sizes.split(",")]
    for r in results:
        for name in ("separate", "fused"):
            k = r[name]["per_layer"]
            print(f"{r['size']:>5} {name:>9}: {k['launched']:3d} ops/layer, {k['matmuls']:2d} matmuls/layer, "
                  f"{k['slice_copies']:2d} slice copies/layer, "
                  f"step {r[name]['step_ms']:.3f} ms ({r['rows']} rows, kv {r['kv_len']})")
        print(f"{r['size']:>5} fused speed-up {r['fused_speedup']:.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"backend": jax.default_backend(), "devices": str(jax.devices()[0]), "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
