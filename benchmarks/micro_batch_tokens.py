"""Train-step time against ``train.micro_batch_tokens`` on this machine's default backend.

One GRPO batch (``--groups`` x ``--group-size`` answers of 40-token prompts and 30-250-token
answers, random tokens) trained with a random-init tiny or small Qwen3-shaped model at each
budget; each budget's trainer first trains the batch twice (compiling every shape it needs),
then the median of ``--steps`` timed steps is reported, with the compile seconds of the timed
steps (0 when no shape was new). The budgets run interleaved, round after round, so a load
change on a shared machine hits them alike.

    python benchmarks/micro_batch_tokens.py [--size small] [--budgets 1024 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import numpy as np
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.models import Decoder, ModelConfig
from areal_jax.models.tiny import TINY_SIZES
from areal_jax.trainer import TrainConfig, Trainer


def batch(rng: np.random.Generator, groups: int, group_size: int, vocab: int) -> list[Trajectory]:
    out = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, 40)
        for _ in range(group_size):
            n = int(rng.integers(30, 250))
            out.append(Trajectory.from_prompt_and_answer(prompt, rng.integers(0, vocab, n), -rng.random(n) - 0.1, 0,
                                                         reward=float(rng.random() < 0.5), group_id=g))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="small", choices=list(TINY_SIZES))
    p.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    cfg = ModelConfig(vocab_size=256, tie_word_embeddings=True, model_type="qwen3", **TINY_SIZES[args.size])
    trajs = batch(np.random.default_rng(0), args.groups, args.group_size, cfg.vocab_size)
    trainers = {}
    for b in args.budgets:
        trainers[b] = Trainer(Decoder(cfg, rngs=nnx.Rngs(0)), AlgoConfig(), TrainConfig(micro_batch_tokens=b, lr=1e-5))
        for v in range(2):
            trainers[b].train_batch(trajs, v)
    times = {b: [] for b in args.budgets}
    compile_s = dict.fromkeys(args.budgets, 0.0)
    for step in range(args.steps):
        for b in args.budgets:
            s = trainers[b].train_batch(trajs, 2 + step)
            times[b].append(s["time_s"])
            compile_s[b] += s["compile_seconds"]
    tokens = sum(len(t) for t in trajs)
    report = {"backend": jax.default_backend(), "size": args.size, "tokens_per_batch": tokens,
              "median_step_s": {b: round(statistics.median(t), 3) for b, t in times.items()},
              "all_steps_s": {b: [round(x, 3) for x in t] for b, t in times.items()},
              "timed_compile_s": compile_s}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
