"""Prompts in (datasets on grain, row formats, chat templates) and trajectories out (packing,
bucketing, padding)."""

from areal_jax.data.datasets import (
    DatasetConfig,
    DatasetError,
    PromptData,
    PromptRow,
    last_boxed,
    load_prompts,
    read_prompts,
)

__all__ = ["DatasetConfig", "DatasetError", "PromptData", "PromptRow", "last_boxed", "load_prompts", "read_prompts"]
