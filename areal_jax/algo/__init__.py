"""Pure JAX functions of the RL algorithm: losses, advantages, KL terms and their config.

Arrays in, arrays and a stats dict out; no I/O and no globals, so everything here jits.
"""

from areal_jax.algo.advantages import (
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    normalize_advantages,
    overlong_penalty,
    rloo_advantages,
    shape_rewards,
    terminal_token_rewards,
)
from areal_jax.algo.config import AlgoConfig, OverlongPenalty, compute_advantages, ppo_loss_kwargs
from areal_jax.algo.kl import kl_k1, kl_k2, kl_k3, kl_loss_term
from areal_jax.algo.ppo import decoupled_ppo_loss
from areal_jax.algo.proximal import approx_proximal_logprobs
from areal_jax.algo.value import clipped_value_loss, explained_variance

__all__ = [
    "AlgoConfig",
    "OverlongPenalty",
    "approx_proximal_logprobs",
    "clipped_value_loss",
    "compute_advantages",
    "decoupled_ppo_loss",
    "dr_grpo_advantages",
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss_term",
    "normalize_advantages",
    "overlong_penalty",
    "ppo_loss_kwargs",
    "rloo_advantages",
    "shape_rewards",
    "terminal_token_rewards",
]
