"""The JAX generation engine: continuous batching over a paged KV pool (or KV slots) with on-device sampling."""

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.types import (
    DuplicateRequestError,
    EngineDeadError,
    GenerateOutput,
    GenerateRequest,
    QueueFullError,
    SamplingParams,
)

__all__ = ["DuplicateRequestError", "Engine", "EngineConfig", "EngineDeadError", "GenerateOutput", "GenerateRequest",
           "QueueFullError", "SamplingParams"]
