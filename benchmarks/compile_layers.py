"""Compile time of the decoder's gradient (or of one KV-cache decode step) against depth, for two
checkouts side by side.

    python benchmarks/compile_layers.py [--step grad|decode] [--layers 2 28] [--length 512] \
        [--rounds 2] [--other PATH_TO_ANOTHER_CHECKOUT] [--out FILE.json]

Each measurement is a fresh process (no warm compilation cache) that lowers and compiles, from
abstract shapes only, a "small"-shaped decoder (hidden 256, 8 heads, 2 KV heads) with ``L``
layers: ``--step grad``, ``jax.jit(jax.value_and_grad(loss))`` on one ``[1, length]`` packed row;
``--step decode``, ``jax.jit(model.decode)`` of one token for 8 slots against a 512-position cache
(attending to 256), the cache donated. With ``--other`` the same measurement runs on that
checkout's code too, alternating, so a before / after ratio is taken under the same machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time, json
import jax, jax.numpy as jnp
from flax import nnx
from areal_jax.models import Decoder, ModelConfig, logprobs_from_logits
layers, length, remat = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
kw = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=8,
          num_key_value_heads=2, head_dim=32)
try:
    cfg = ModelConfig(**kw, remat=remat)
except (TypeError, ValueError):  # a checkout whose remat is a bool
    cfg = ModelConfig(**kw, remat=remat != "none")
graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
ids = jax.ShapeDtypeStruct((1, length), jnp.int32)

def loss(state, ids):
    m = nnx.merge(graphdef, state)
    return -jnp.mean(logprobs_from_logits(m(ids)[:, :-1], ids[:, 1:]))

start = time.perf_counter()
jax.jit(jax.value_and_grad(loss)).lower(state, ids).compile()
print(json.dumps({"compile_s": time.perf_counter() - start}))
"""

DECODE_CHILD = r"""
import sys, time, json
import jax, jax.numpy as jnp
from flax import nnx
from areal_jax.models import Decoder, ModelConfig
layers = int(sys.argv[1])
cfg = ModelConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32)
graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
cache = jax.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)).init_cache(8, 512))
ids = jax.ShapeDtypeStruct((8, 1), jnp.int32)

def step(state, cache, ids):
    return nnx.merge(graphdef, state).decode(ids, jnp.zeros((8, 1), jnp.int32), cache, kv_len=256)

start = time.perf_counter()
jax.jit(step, donate_argnums=1).lower(state, cache, ids).compile()
print(json.dumps({"compile_s": time.perf_counter() - start}))
"""


def measure(code_root: Path, layers: int, length: int, remat: str, step: str = "grad") -> float:
    env = dict(os.environ, PYTHONPATH=str(code_root), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    child = CHILD if step == "grad" else DECODE_CHILD
    proc = subprocess.run([sys.executable, "-c", child, str(layers), str(length), remat], env=env,
                          capture_output=True, text=True, cwd=code_root, check=False)
    if proc.returncode:
        raise RuntimeError(f"{code_root}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["compile_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=["grad", "decode"], default="grad", help="the program compiled")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 28])
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--remat", default="none")
    p.add_argument("--other", type=Path, default=None, help="another checkout to measure beside this one")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    roots = {"this": ROOT} | ({"other": args.other.resolve()} if args.other else {})
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in args.layers} for k in roots}
    for _ in range(args.rounds):
        for n in args.layers:
            for name, root in roots.items():
                times[name][n].append(measure(root, n, args.length, args.remat, args.step))
    if args.step == "grad":
        print(f"grad compile time, best of {args.rounds} (s), [1, {args.length}] tokens, remat={args.remat}")
    else:
        print(f"decode step compile time, best of {args.rounds} (s), 8 slots x 1 token, 512-position cache")
    print("| layers | " + " | ".join(roots) + " |")
    print("|---|" + "---|" * len(roots))
    for n in args.layers:
        print(f"| {n} | " + " | ".join(f"{min(times[k][n]):.2f}" for k in roots) + " |")
    if args.out:
        args.out.write_text(json.dumps({k: {str(n): v for n, v in t.items()} for k, t in times.items()}, indent=2))


if __name__ == "__main__":
    main()
