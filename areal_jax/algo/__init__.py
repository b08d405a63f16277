"""Pure JAX functions of the RL algorithm: losses, advantages, KL terms and their config.

Arrays in, arrays and a stats dict out; no I/O and no globals, so everything here jits.
"""

from areal_jax.algo.ppo import decoupled_ppo_loss

__all__ = ["decoupled_ppo_loss"]
