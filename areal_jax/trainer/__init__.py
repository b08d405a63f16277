"""The trainer: the decoupled-PPO train step over packed micro-batches, and its config.

The names load on first use, so that importing a config module of this package
(``areal_jax.trainer.run_config``, for ``--print-config``) does not load the train step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_jax.trainer.config import TrainConfig
    from areal_jax.trainer.train_step import PreparedBatch, Trainer

__all__ = ["PreparedBatch", "TrainConfig", "Trainer"]

_WHERE = {"TrainConfig": "areal_jax.trainer.config", "PreparedBatch": "areal_jax.trainer.train_step",
          "Trainer": "areal_jax.trainer.train_step"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'areal_jax.trainer' has no attribute {name!r}")
