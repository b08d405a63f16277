"""The on-device sampler on crafted logits, and sampling-parameter validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.inference.sampling import row_keys, sample
from areal_jax.inference.types import SamplingParams

# Probabilities 0.4, 0.3, 0.2, 0.1 on tokens 3, 0, 2, 1 (the rest of an 8-token vocabulary ~0).
PROBS = np.array([0.3, 0.1, 0.2, 0.4, 0, 0, 0, 0])
LOGITS = np.log(np.maximum(PROBS, 1e-30)).astype(np.float32)


def draw(temperature: float, top_p: float, top_k: int, n: int = 512) -> np.ndarray:
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    keys = row_keys(jnp.zeros(n, jnp.uint32), jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    full = lambda v, dt: jnp.full((n,), v, dt)
    ids, logprobs = jax.jit(sample)(logits, full(temperature, jnp.float32), full(top_p, jnp.float32),
                                    full(top_k, jnp.int32), keys)
    scaled = jax.nn.log_softmax(jnp.asarray(LOGITS) / (temperature or 1.0))
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(scaled)[np.asarray(ids)], rtol=1e-6)
    return np.asarray(ids)


@pytest.mark.parametrize(("top_p", "top_k", "allowed"), [
    (1.0, 2, {3, 0}),
    (1.0, 3, {3, 0, 2}),
    (0.5, -1, {3, 0}),      # 0.4 < 0.5, so the second token is needed
    (0.35, -1, {3}),
    (0.75, 2, {3, 0}),      # top-k is the tighter cut
    (1.0, -1, {3, 0, 2, 1}),
])
def test_samples_stay_in_allowed_set(top_p: float, top_k: int, allowed: set[int]) -> None:
    ids = draw(1.0, top_p, top_k)
    assert set(ids.tolist()) == allowed  # every allowed token shows up in 512 draws, nothing else


def test_top_k_one_and_temperature_zero_are_greedy() -> None:
    assert set(draw(1.0, 1.0, 1).tolist()) == {3}
    assert set(draw(0.0, 0.3, 5).tolist()) == {3}


def test_rows_keep_their_own_parameters() -> None:
    logits = jnp.tile(jnp.asarray(LOGITS), (4, 1))
    keys = row_keys(jnp.full(4, 7, jnp.uint32), jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.int32))
    temps, top_p, top_k = jnp.array([0.0, 1.0, 1.0, 1.0]), jnp.array([1.0, 0.4, 1.0, 1.0]), jnp.array([-1, -1, 1, -1])
    ids, _ = jax.jit(sample)(logits, temps, top_p, top_k, keys)
    assert ids[:3].tolist() == [3, 3, 3]


def test_same_key_same_token() -> None:
    a, b = draw(1.0, 0.9, -1), draw(1.0, 0.9, -1)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=1e39)),  # beyond float32: it would sample at an infinite temperature
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=0)),
    ("top_k", dict(top_k=-2)),
    ("max_new_tokens", dict(max_new_tokens=-1)),
    ("stop_token_ids", dict(stop_token_ids=[5, 128])),
])
def test_bad_sampling_params_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate(vocab_size=128)
    SamplingParams().validate(vocab_size=128)
