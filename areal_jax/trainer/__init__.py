"""The trainer: the decoupled-PPO train step over packed micro-batches, and its config."""

from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.train_step import PreparedBatch, Trainer

__all__ = ["PreparedBatch", "TrainConfig", "Trainer"]
