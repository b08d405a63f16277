"""Held-out evaluation: accuracy and mean reward of the served policy on the eval split, during a
run (``evaluate``) or for a saved checkpoint (``evaluate_checkpoint``, ``areal-jax eval``, which
serves it with ``trainer/rollout.py``'s ``open_rollout``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.controller import EpisodeClient
from areal_jax.trainer.rollout import local_run_dir, open_rollout
from areal_jax.trainer.run_config import EvalConfig, RunConfig


async def evaluate(client: EpisodeClient, rows: list[Any], cfg: EvalConfig, *, max_new_tokens: int,
                   concurrency: int = 64) -> dict[str, Any]:
    """Accuracy (reward >= ``correct_threshold``) and mean reward on ``rows``."""
    rows = rows[: cfg.max_prompts] if cfg.max_prompts else rows
    if not rows:
        return {}
    sem = asyncio.Semaphore(concurrency)
    overrides: dict[str, Any] = {"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens or max_new_tokens}
    if cfg.temperature == 0:
        overrides.update(top_p=1.0, top_k=-1)

    async def one(row: Any) -> float:
        async with sem:
            result = await client.generate(row.prompt_ids, **overrides)
            return await client.reward(row, client.decode(result.output_ids))

    t0 = time.perf_counter()
    rewards = np.array(await asyncio.gather(*(one(r) for r in rows)))
    return {"eval_accuracy": float(np.mean(rewards >= cfg.correct_threshold)), "eval_reward": float(rewards.mean()),
            "eval_prompts": len(rows), "eval_seconds": time.perf_counter() - t0}


def evaluate_checkpoint(cfg: RunConfig, model_path: str | Path) -> dict[str, Any]:
    """Serve ``model_path`` as the config's rollout says and evaluate it on the eval split."""
    from areal_jax.config import ConfigError
    from areal_jax.data import load_prompts
    from areal_jax.models import load_tokenizer
    from areal_jax.rewards import RewardPool

    model_path = Path(model_path)
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"--model-path {model_path}: no config.json; point it at a HF model directory "
                                "(e.g. <run dir>/final)")
    tokenizer = load_tokenizer(model_path)
    data = load_prompts(cfg.data, tokenizer)
    if not data.eval_rows:
        raise ConfigError("the config's data section has no held-out split (set data.eval_path or data.eval_fraction)")

    async def run() -> dict[str, Any]:
        async with open_rollout(cfg, model_path, local_run_dir(cfg) / "logs-eval") as (client, _):
            if cfg.rollout.backend == "servers":
                await client.update_weights_from_disk(str(model_path), version=0)
            with RewardPool(cfg.reward) as pool:
                ep = EpisodeClient(client, tokenizer, pool, cfg.rollout.sampling_params())
                return await evaluate(ep, data.eval_rows, cfg.eval, max_new_tokens=cfg.rollout.max_new_tokens)

    return asyncio.run(run())
