"""The JAX generation engine: continuous batching over KV slots with on-device sampling."""

from areal_jax.inference.engine import Engine, EngineConfig
from areal_jax.inference.types import GenerateOutput, GenerateRequest, SamplingParams

__all__ = ["Engine", "EngineConfig", "GenerateOutput", "GenerateRequest", "SamplingParams"]
