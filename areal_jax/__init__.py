"""areal-jax: fully asynchronous RL for LLM reasoning (AReaL) in JAX/Flax."""

__version__ = "0.1.0"


def train(config, overrides=()):  # noqa: ANN001, ANN201 - re-exported; typed in areal_jax.trainer.rl
    """Run RL from a ``RunConfig``, a YAML path or a dict (see ``areal_jax.trainer.rl.train``)."""
    from areal_jax.trainer.rl import train as _train

    return _train(config, overrides)
