"""Multi-host start: ``jax.distributed.initialize`` from config (TPU pods, GPU clusters, or several
CPU processes on one machine for tests), and reading an array sharded over processes back whole."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


@dataclass(frozen=True)
class DistributedConfig:
    """Set ``num_processes`` > 1 to join a multi-process JAX runtime before any device is used."""

    coordinator_address: str | None = None
    """host:port of process 0; None lets JAX discover it (TPU pods, SLURM)."""
    num_processes: int = 1
    process_id: int | None = None
    local_device_ids: list[int] | None = None
    """Restrict this process to some local accelerators (a GPU host split between jobs)."""
    cpu_collectives: str = "gloo"
    """Collectives implementation for the CPU backend (multi-process tests): gloo or mpi."""


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Join the multi-process runtime; returns False (and does nothing) for a single process."""
    if cfg.num_processes <= 1 and cfg.coordinator_address is None:
        return False
    if cfg.process_id is not None and not 0 <= cfg.process_id < cfg.num_processes:
        raise ValueError(
            f"distributed.process_id={cfg.process_id} is outside 0..{cfg.num_processes - 1}"
        )
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
        local_device_ids=cfg.local_device_ids,
    )
    return True


def gather_to_host(x: jax.Array, fetch: bool = True) -> np.ndarray | None:
    """The full value of a (possibly multi-host sharded) array on this process. Across
    processes the all-gather is collective, so every process calls this for every array; one
    that passes ``fetch=False`` takes part without copying the result to its host (None)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x)) if fetch else None
    if not isinstance(x.sharding, NamedSharding):
        from jax.experimental import multihost_utils

        full_host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return full_host if fetch else None
    full = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
    return np.asarray(full.addressable_data(0)) if fetch else None
