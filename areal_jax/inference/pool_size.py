"""How many tokens the paged engine's KV pool holds (SGLang's ``max_total_num_tokens``): from
``--max-total-tokens``, or from the memory the device (or, on a CPU, the host) has left after the
weights, at the bytes one token's keys and values take in every layer."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.schedule import kv_pool_tokens
from areal_jax.models.decoder import Decoder, kv_head_replicas

__all__ = ["DEFAULT_DEVICE_FRACTION", "DEFAULT_HOST_FRACTION", "kv_bytes_per_token", "pool_tokens"]

DEFAULT_DEVICE_FRACTION = 0.85
DEFAULT_HOST_FRACTION = 0.25


def kv_bytes_per_token(model: Decoder, dtype: Any = None) -> int:
    """Bytes one token's keys and values take in every layer of the pool."""
    cfg = model.config
    heads = cfg.num_key_value_heads * kv_head_replicas(cfg.num_key_value_heads)
    itemsize = np.dtype(dtype if dtype is not None else cfg.jnp_dtype).itemsize
    return 2 * cfg.num_hidden_layers * heads * cfg.head_dim * itemsize


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory (``/proc/meminfo``; sysconf where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


def pool_tokens(cfg: EngineConfig, model: Decoder) -> int:
    """The KV pool's size in tokens (SGLang's ``max_total_num_tokens``) for ``cfg``.

    ``max_total_tokens`` alone sets it. Otherwise it comes from memory (``schedule.kv_pool_tokens``):
    on a device that reports its memory, weights and pool may take ``mem_fraction_static``
    (default 0.85) of it; on a CPU, which reports none, the pool may take that share (default
    0.25) of the host's available memory. Either way it never exceeds ``num_slots * max_seq_len``
    (every running request at full context: more could never be used) nor ``max_total_tokens``."""
    page = cfg.page_size
    per_token = kv_bytes_per_token(model, cfg.cache_dtype)
    most = -(-cfg.num_slots * cfg.max_seq_len // page) * page
    if cfg.max_total_tokens is not None and cfg.mem_fraction_static is None:
        return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=cfg.max_total_tokens)
    stats = None
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats (CPU) says so in several ways
        stats = None
    cap = most if cfg.max_total_tokens is None else min(most, cfg.max_total_tokens)
    if stats and "bytes_limit" in stats:
        fraction = cfg.mem_fraction_static or DEFAULT_DEVICE_FRACTION
        total = int(stats["bytes_limit"])
        free = total - int(stats.get("bytes_in_use", 0))
        return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=cap,
                              mem_fraction_static=fraction, device_bytes=total, free_bytes=free)
    fraction = cfg.mem_fraction_static or DEFAULT_HOST_FRACTION
    _, available = _host_memory()
    tokens = min(cap, int(available * fraction) // per_token)
    return kv_pool_tokens(page_size=page, bytes_per_token=per_token, max_total_tokens=max(tokens, page))
