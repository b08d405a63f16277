"""areal-jax: fully asynchronous RL for LLM reasoning (AReaL) in JAX/Flax."""

__version__ = "0.1.0"
