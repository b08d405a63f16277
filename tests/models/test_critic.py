"""``Critic.from_policy`` copies the policy's trunk (not its buffers, not its LM head) and gives one
float32 value per position that depends only on the tokens up to that position."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Critic
from tests.trainer.helpers import tiny_model


@pytest.mark.parametrize("tied", [True, False])
def test_from_policy_copies_the_trunk_without_lm_head(tied: bool) -> None:
    policy = tiny_model(seed=4, tie_word_embeddings=tied)
    critic = Critic.from_policy(policy, nnx.Rngs(1))
    assert critic.trunk.lm_head is None  # a critic never forms logits
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)))
    np.testing.assert_array_equal(critic.trunk.hidden_states(ids), policy.hidden_states(ids))
    p_emb = nnx.state(policy, nnx.Param)["embed_tokens"]["embedding"][...]
    c_emb = nnx.state(critic, nnx.Param)["trunk"]["embed_tokens"]["embedding"][...]
    assert p_emb.unsafe_buffer_pointer() != c_emb.unsafe_buffer_pointer()  # a copy, safe from donation
    values = critic(ids)
    assert values.shape == (2, 12) and values.dtype == jnp.float32


def test_value_at_a_position_sees_only_tokens_up_to_it() -> None:
    critic = Critic(tiny_model().config, rngs=nnx.Rngs(2))
    ids = np.random.default_rng(1).integers(0, 128, (1, 10))
    changed = ids.copy()
    changed[0, 6] = (changed[0, 6] + 1) % 128
    a, b = jax.device_get(critic(jnp.asarray(ids))), jax.device_get(critic(jnp.asarray(changed)))
    np.testing.assert_array_equal(a[0, :6], b[0, :6])
    assert np.abs(a[0, 6:] - b[0, 6:]).min() > 0
