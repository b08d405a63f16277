"""How close the paged attention kernel's decode is to float32, beside the XLA path's.

One greedy answer per seed is decoded in float32 with the XLA paged attention (the reference);
then, in ``--dtype`` (bfloat16 by default), the XLA path (``native``) and the maintained kernel
(``fa``: Pallas GPU paged attention; on a CPU it runs in Pallas interpret mode) decode the same
tokens (teacher-forced, so one flipped near-tie does not send the rest down another path). Per
backend: the mean and largest |logprob - float32 logprob| of the reference's tokens, and how often
its greedy choice is float32's. A kernel as close to float32 as the XLA path is computes what the
XLA path does, up to the dtype's rounding; greedy answers that part ways after a few tokens then
come from near-ties (random weights make them common), not from a fault.

    python benchmarks/kernel_numerics.py [--model long_tail | --shape qwen2.5-1.5b] [--seeds 3] [--steps 200]
                                         [--dtype bfloat16] [--out f.json]

``--model long_tail``: the bench's shipped warm start (trained weights, tiny). ``--shape``: random
weights with a real model's shapes (``benchmarks/accelerator.py``'s ``MODELS``), for a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.inference.pages import PageAllocator, PageTable, paged_work
from areal_jax.models.attention import PagedWork

PAGE = 16


def _models(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """(float32 model, ``args.dtype`` model with the same weights, vocabulary size)."""
    from areal_jax.models import load_pretrained

    if args.shape:
        from flax import nnx

        sys.path.insert(0, str(Path(__file__).parent))
        from accelerator import MODELS  # the shape table of the accelerator benchmark

        from areal_jax.models import Decoder, ModelConfig

        ref = Decoder(ModelConfig(**MODELS[args.shape], param_dtype="float32", dtype="float32"), rngs=nnx.Rngs(0))
        low = Decoder(ModelConfig(**MODELS[args.shape], param_dtype=args.dtype, dtype=args.dtype), rngs=nnx.Rngs(0))
        nnx.update(low, jax.tree.map(lambda x: x.astype(args.dtype), nnx.state(ref, nnx.Param)))
        return ref, low, ref.config.vocab_size
    from areal_jax.bench import tasks

    path = tasks.SHIPPED_WARM_STARTS / args.model if args.model in ("long_tail",) else Path(args.model)
    ref = load_pretrained(path)
    return ref, load_pretrained(path, dtype=args.dtype), ref.config.vocab_size


@functools.cache
def _step(backend: str) -> Any:
    """One jitted paged call per backend, shared by every seed's decode (compiled once a shape)."""
    return jax.jit(lambda m, ids, pos, cache, wp, wo, work: m.decode_paged(
        ids, pos, cache, write_pages=wp, write_offsets=wo, work=PagedWork(*work), backend=backend))


def _decode(model: Any, backend: str, prompt: np.ndarray, steps: int, forced: list[int] | None) -> tuple:
    """Logprobs ``[steps, vocab]`` of each next token after ``prompt``, greedy or ``forced``."""
    step = _step(backend)
    pages = -(-(len(prompt) + steps) // PAGE) + 1
    pool = PageAllocator(num_pages=pages, page_size=PAGE)
    cache = model.init_paged_cache(pool.num_pages, PAGE)
    table = PageTable(pool)
    size = 1 << (pages - 1).bit_length()

    def call(ids: np.ndarray, start: int) -> np.ndarray:
        nonlocal cache
        end = start + len(ids)
        table.reserve(end)
        wp, wo = table.write_slots(start, end)
        work = tuple(map(jnp.asarray, paged_work([table.pages], [end], PAGE, size=size)))
        logits, cache = step(model, jnp.asarray(ids[None]), jnp.arange(start, end, dtype=jnp.int32)[None], cache,
                             jnp.asarray(wp[None]), jnp.asarray(wo[None]), work)
        return np.asarray(jax.nn.log_softmax(logits[0, -1].astype(jnp.float32)))

    out, tokens = [call(prompt, 0)], []
    for s in range(steps - 1):
        tok = forced[s] if forced is not None else int(np.argmax(out[-1]))
        tokens.append(tok)
        out.append(call(np.asarray([tok], np.int32), len(prompt) + s))
    tokens.append(forced[steps - 1] if forced is not None else int(np.argmax(out[-1])))
    return np.stack(out), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="long_tail")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ref_model, low_model, vocab = _models(args)
    rows = []
    for seed in range(args.seeds):
        prompt = np.random.default_rng(seed).integers(4, min(vocab, 30000), args.prompt_len).astype(np.int32)
        ref, tokens = _decode(ref_model, "native", prompt, args.steps, None)
        idx = np.arange(args.steps)
        got = {}
        for backend in ("native", "fa"):
            t0 = time.perf_counter()
            lp, _ = _decode(low_model, backend, prompt, args.steps, tokens)
            err = np.abs(lp[idx, tokens] - ref[idx, tokens])
            got[backend] = lp
            rows.append({"seed": seed, "backend": backend, "dtype": args.dtype,
                         "mean_abs_logprob_err": float(err.mean()), "max_abs_logprob_err": float(err.max()),
                         "argmax_agrees_with_float32": float(np.mean(lp.argmax(1) == ref.argmax(1))),
                         "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"seed": seed, "fa_vs_native_argmax_agree": float(np.mean(got["fa"].argmax(1) ==
                                                                              got["native"].argmax(1))),
                     "fa_vs_native_max_abs": float(np.abs(got["fa"] - got["native"]).max())})
        print(json.dumps(rows[-1]), flush=True)
    result = {"backend": jax.default_backend(), "devices": str(jax.devices()), "args": vars(args), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
