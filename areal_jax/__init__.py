"""areal-jax: fully asynchronous RL for LLM reasoning (AReaL) in JAX/Flax."""

__version__ = "0.1.0"

CACHE_ROOT = "~/.cache/areal-jax"
"""Where areal-jax keeps what outlives a run on this machine (compiled programs, local copies of
URL run directories, the tokenizer class record); unexpanded."""


def train(config, overrides=()):  # noqa: ANN001, ANN201 - re-exported; typed in areal_jax.trainer.rl
    """Run RL from a ``RunConfig``, a YAML path or a dict (see ``areal_jax.trainer.rl.train``)."""
    from areal_jax.trainer.rl import train as _train

    return _train(config, overrides)
