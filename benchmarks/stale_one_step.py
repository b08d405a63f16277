"""Decoupled PPO with one optimizer step per batch on data that is all one version stale: the
setting of an asynchronous run whose rollout keeps ahead of the trainer (the in-process engine on
a small model does), at a learning rate with no trust region left.

The task: a random-init tiny Qwen3 (4 layers, hidden 256) earns reward 1 when its 64-token answer
(``ignore_eos``) contains the letter ``z``; 8 prompts x 4 answers per step, GRPO, KL 0.04, lr 1e-3,
no gradient clip, one PPO minibatch, ``max_staleness`` 1. Each run prints its reward, staleness and
behaviour-weight curve; ``--check`` keeps every trained batch and every pushed version's weights
and then recomputes each trained token's logprob under the version it is stamped with (the
version invariant on a real run), and the policy's move per step, KL(pi_v || pi_v+1) per token on
the batch trained at v (importance-weighted from its behaviour policy).

    python benchmarks/stale_one_step.py --out runs/stale --backend local [--check] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from typing import Any

TARGET = "z"
PROMPT_WORDS = ["tell", "me", "a", "story", "about", "cats", "dogs", "the", "sea", "write", "poem", "list"]


def score(prompt: str, completion: str, **_: Any) -> float:
    """The task's reward: 1 when the completion contains ``TARGET``."""
    return 1.0 if TARGET in completion else 0.0


async def episode(client: Any, row: Any) -> list[Any]:
    """``single_turn`` with ``ignore_eos``: every answer is the full 64 tokens."""
    results = await client.generate_group(row.prompt_ids, ignore_eos=True)

    async def scored(r: Any) -> Any:
        return client.trajectory(row.prompt_ids, r, await client.reward(row, client.decode(r.output_ids)))

    return list(await asyncio.gather(*(scored(r) for r in results)))


def overrides(out: Path, prompts: Path, backend: str) -> list[str]:
    here = "benchmarks.stale_one_step"
    return [
        f"run_dir={out}", "steps=25", "seed=0", "batch_size=8", "export=false", "log.progress=false",
        "model.tiny=small", "model.model_type=qwen3",
        "data.source=jsonl", f"data.path={prompts}", "data.format=generic", "data.prompt_field=prompt",
        f"reward.name={here}:score", "reward.num_workers=1", f"rollout.workflow={here}:episode",
        f"rollout.backend={backend}", "rollout.group_size=4", "rollout.max_new_tokens=64",
        "rollout.mode=async", "rollout.max_staleness=1",
        'rollout.server_args=["--max-running-requests", "32", "--context-length", "128"]',
        "algo.adv_estimator=grpo", "algo.kl_coef=0.04", "algo.ppo_n_minibatches=1",
        "train.lr=0.001", "train.grad_clip=null", "train.micro_batch_tokens=4096", "train.length_buckets=[4096]",
        "train.max_seq_len=128", "eval.every=0",
    ]


def run_config(out: Path, backend: str, extra: list[str] | tuple[str, ...] = ()) -> Any:
    """The task's ``RunConfig`` in run directory ``out`` (its prompts written there), with
    ``extra`` overrides."""
    import random

    from areal_jax.trainer.run_config import load_run_config

    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    rng = random.Random(0)
    prompts.write_text("".join(json.dumps({"prompt": " ".join(rng.choices(PROMPT_WORDS, k=4)) + f" {i}"}) + "\n"
                               for i in range(256)))
    return load_run_config(None, [*overrides(out, prompts.absolute(), backend), *extra])


def record(kept: dict[str, Any]) -> None:
    """Keep each trained batch and, at each push, a host copy of the version's weights."""
    import jax
    import numpy as np

    from areal_jax.trainer import Trainer

    train_batch = Trainer.train_batch

    def recorded(self: Any, trajectories: Any, version: int) -> Any:
        kept["params"].setdefault(version, jax.tree.map(np.array, self.policy.params))
        kept["batches"].append((version, list(trajectories)))
        stats = train_batch(self, trajectories, version)
        kept["params"].setdefault(version + 1, jax.tree.map(np.array, self.policy.params))
        return stats

    Trainer.train_batch = recorded


def check(cfg: Any, kept: dict[str, Any]) -> dict[str, Any]:
    """The invariant over every trained token, and the policy's move per step."""
    import numpy as np

    from areal_jax.models import load_pretrained
    from areal_jax.trainer import Trainer
    from areal_jax.trainer.learner import place

    trainer = Trainer(load_pretrained(Path(cfg.run_dir) / "base"), cfg.algo, cfg.train)
    params = {v: place(p, trainer.policy.shardings) for v, p in kept["params"].items()}
    worst, tokens, moves = 0.0, 0, []
    for version, trajs in kept["batches"]:
        micro = trainer.preparer.pack(trajs, range(len(trajs)))
        lens = [len(t) for t in trajs]
        lp = {v: trainer.preparer.logprobs(trainer.policy, micro, lens, params[v])
              for v in sorted({int(x) for t in trajs for x in t.versions if x >= 0} | {version, version + 1})}
        num = den = 0.0
        for k, t in enumerate(trajs):
            at = t.loss_mask > 0
            for v in set(t.versions[at].tolist()):
                sel = np.flatnonzero(at)[t.versions[at] == v]
                worst = max(worst, float(np.abs(t.behavior_logprobs[sel] - lp[v][k][sel]).max()))
                tokens += len(sel)
            w = np.exp(lp[version][k][at] - t.behavior_logprobs[at])
            num += float((w * (lp[version][k][at] - lp[version + 1][k][at])).sum())
            den += float(w.sum())
        moves.append(round(num / den, 4))
    return {"tokens_checked": tokens, "max_abs_behaviour_minus_recomputed": worst, "kl_per_step": moves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="run directory")
    ap.add_argument("--backend", default="local", choices=["local", "embedded"])
    ap.add_argument("--check", action="store_true", help="check the version invariant on every trained token")
    ap.add_argument("extra", nargs="*", help="more key=value overrides (rollout.mode=sync, train.lr=3e-4, ...)")
    args = ap.parse_args()
    from areal_jax.trainer.rl import train

    cfg = run_config(Path(args.out), args.backend, args.extra)
    kept: dict[str, Any] = {"batches": [], "params": {}}
    if args.check:
        record(kept)
    result = train(cfg)
    summary: dict[str, Any] = {key: [round(float(m.get(key, 0.0)), 3) for m in result.metrics]
                               for key in ("reward_mean", "staleness_mean", "behavior_imp_weight_max")}
    if args.check:
        summary.update(check(cfg, kept))
    print(json.dumps(summary))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
