"""Rewards: verifiers (math-verify, reasoning-gym scorers, code tests in a sandbox) and the
process pool that runs them off the trainer's process and the rollout's critical path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal_jax.rewards.pool import RewardConfig, RewardPool, RewardPoolBroken, RewardResult

RewardFn = Callable[..., Any]


def get_reward_fn(name: str) -> RewardFn:
    """A built-in reward (``math``, ``reasoning_gym``, ``code``) or a user's by import path
    (``my_pkg.rewards:score``), called as ``fn(prompt, completion, **row_fields)``."""
    from areal_jax.rewards.builtin import BUILTIN

    if name in BUILTIN:
        return BUILTIN[name]
    from areal_jax.config import ConfigError, resolve_import_path

    try:
        return resolve_import_path(name, "reward.name")
    except ConfigError as e:
        raise ValueError(f"{e}; built-in rewards are {sorted(BUILTIN)}") from None


__all__ = ["RewardConfig", "RewardFn", "RewardPool", "RewardPoolBroken", "RewardResult", "get_reward_fn"]
