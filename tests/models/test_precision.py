"""Numerics of the decoder's matmuls: float32 logits in bfloat16 mode, HIGHEST precision in
float32 mode, a hashable graph for static jit arguments."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import load_pretrained
from tests.models.jaxprs import dot_generals

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied head, untied head
def test_bfloat16_logprobs_carry_only_float32_noise(family: str) -> None:
    """bfloat16 weights and activations, yet the head's output is float32-accurate: its logprobs
    equal those of a float64 head over the same bfloat16 hidden states and weights."""
    model = load_pretrained(FIXTURES / f"hf_{family}", dtype="bfloat16")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 11)), jnp.int32)
    hidden = model.hidden_states(ids)
    assert hidden.dtype == jnp.bfloat16
    logits = model.logits_from_hidden(hidden)
    assert logits.dtype == jnp.float32
    head = model.embed_tokens.embedding[...].T if model.lm_head is None else model.lm_head.kernel[...]
    ref = np.asarray(hidden, np.float64) @ np.asarray(head, np.float64)
    # x10 the logits' scale so a bfloat16-rounded head (relative error 2**-9) would be far off.
    err = np.abs(_np_log_softmax(10 * np.asarray(logits, np.float64)) - _np_log_softmax(10 * ref)).max()
    assert err < 1e-4, err


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_float32_mode_multiplies_at_highest_precision(family: str) -> None:
    """Projections, attention (packed, windowed and cached) and the head, tied or not: no matmul
    is left at the backend's default precision, which on TPU is one bfloat16 pass."""
    model = load_pretrained(FIXTURES / f"hf_{family}")
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 8), jnp.int32)

    def forward(state, window):
        return nnx.merge(graphdef, state)(ids, attention_window=window)

    def decode(state):
        m = nnx.merge(graphdef, state)
        return m.decode(ids, jnp.broadcast_to(jnp.arange(8), (1, 8)), m.init_cache(1, 16), kv_len=16)[0]

    for fn in (lambda s: forward(s, None), lambda s: forward(s, 4), decode):
        dots = dot_generals(jax.make_jaxpr(fn)(state).jaxpr)
        assert len(dots) >= 7 + 1  # q, k, v, o, gate, up, down (once: layers run in a scan), the head
        low = [str(e) for e in dots if e.params["precision"] != (jax.lax.Precision.HIGHEST,) * 2]
        assert not low, low[:2]


@pytest.mark.parametrize("window", [None, 4])
def test_float32_dot_product_attention_multiplies_at_highest_precision(window: int | None) -> None:
    """``attention_impl="dot_product"`` hands attention to ``jax.nn.dot_product_attention``, which
    takes no precision argument; a ``default_matmul_precision`` context sets it. Every matmul of
    the lowered forward, attention's included, is HIGHEST."""
    model = load_pretrained(FIXTURES / "hf_qwen2", attention_impl="dot_product")
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 8), jnp.int32)
    segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2]])
    forward = lambda s: nnx.merge(graphdef, s)(ids, segment_ids=segments, attention_window=window)
    dots = [line.strip() for line in jax.jit(forward).lower(state).as_text().splitlines()
            if "stablehlo.dot_general" in line]
    assert len(dots) >= 7 + 2 + 1  # projections, attention's two matmuls, the head
    low = [d for d in dots if "precision = [HIGHEST, HIGHEST]" not in d]
    assert not low, low[:2]


def test_graphdef_with_rope_scaling_is_a_static_jit_argument() -> None:
    """Llama 3.1 configs carry a rope_scaling mapping; the config, and so the GraphDef, hash."""
    model = load_pretrained(FIXTURES / "hf_llama")
    assert model.config.rope_scaling["rope_type"] == "llama3"
    graphdef, state = nnx.split(model)
    hash(graphdef)
    ids = jnp.arange(6)[None]
    run = jax.jit(lambda g, s: nnx.merge(g, s)(ids), static_argnums=0)
    np.testing.assert_allclose(np.asarray(run(graphdef, state)), np.asarray(model(ids)), atol=1e-6)
