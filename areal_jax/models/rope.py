"""Rotary position embeddings: the inverse frequencies of a config (with the RoPE scalings the
decoder implements, ``ROPE_SCALINGS``) and their rotation of queries and keys, in HF's
rotate-half layout."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from areal_jax.models.config import ModelConfig


def _rope_default(inv_freq: np.ndarray, _: dict[str, Any]) -> np.ndarray:
    return inv_freq


def _rope_linear(inv_freq: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    return inv_freq / p["factor"]


def _rope_llama3(inv_freq: np.ndarray, p: dict[str, Any]) -> np.ndarray:
    # Llama 3.1's frequency-dependent scaling: long wavelengths are divided by `factor`, short
    # ones kept, and the band between interpolated smoothly.
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled)


ROPE_SCALINGS = {"default": _rope_default, "linear": _rope_linear, "llama3": _rope_llama3}


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    params = cfg.rope_scaling or {}
    kind = params.get("rope_type", "default")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {sorted(ROPE_SCALINGS)}")
    return ROPE_SCALINGS[kind](inv_freq, params).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate ``x [b, t, heads, d]`` by ``positions [b, t]`` (HF's rotate-half layout)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
