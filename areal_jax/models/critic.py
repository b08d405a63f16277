"""``Critic``: the value model of PPO, a decoder trunk with a scalar head in place of the LM head.

The trunk is the policy's own architecture (``Decoder``), usually started from the policy's
weights; the head maps each position's final hidden state to a value. Position ``j``'s output is
the value of the state "tokens ``0..j`` seen", i.e. the value before token ``j + 1`` is sampled:
the same position whose logits give token ``j + 1``'s logprob.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import Decoder


class Critic(nnx.Module):
    """A ``Decoder`` trunk plus ``value_head`` (``hidden -> 1``); no logits are ever formed."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # Tied embeddings drop the untied lm_head from the trunk: the critic never forms logits,
        # so an lm_head would be dead weight in memory and in the optimizer state.
        cfg = cfg.replace(tie_word_embeddings=True)
        self.trunk = Decoder(cfg, rngs=rngs)
        self.config = cfg
        with nnx.use_eager_sharding(not jax.sharding.get_abstract_mesh().empty):
            # Small init: values start near 0 (the scale of centred rewards) while the trunk
            # still receives gradients from the first step on, which a zero kernel would block.
            self.value_head = nnx.Linear(
                cfg.hidden_size, 1, dtype=jnp.float32, param_dtype=cfg.jnp_param_dtype,
                kernel_init=nnx.with_partitioning(nnx.initializers.normal(0.02), ("embed", None)),
                bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (None,)),
                precision=jax.lax.Precision.HIGHEST, rngs=rngs,
            )

    @classmethod
    def from_policy(cls, policy: Decoder, rngs: nnx.Rngs) -> Critic:
        """A critic whose trunk is a copy of ``policy``'s (embeddings, layers, final norm) and
        whose value head is freshly initialised from ``rngs``."""
        critic = cls(policy.config, rngs=rngs)
        source = nnx.to_pure_dict(nnx.state(policy, nnx.Param))
        source.pop("lm_head", None)
        target = nnx.state(critic.trunk, nnx.Param)
        # Copies, never aliases: a trainer donates the policy's buffers on every update.
        nnx.replace_by_pure_dict(target, jax.tree.map(lambda x: jnp.array(x, copy=True), source))
        nnx.update(critic.trunk, target)
        return critic

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, *, attention_window: int | None = None,
                 attention_pairs: jax.Array | None = None, attention_block: int = 64) -> jax.Array:
        """Values ``[batch, tokens]`` in float32, for packed or padded input as ``Decoder`` takes it."""
        hidden = self.trunk.hidden_states(input_ids, positions, segment_ids, attention_window=attention_window,
                                          attention_pairs=attention_pairs, attention_block=attention_block)
        return self.value_head(hidden.astype(jnp.float32))[..., 0]
