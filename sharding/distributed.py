"""Multi-host start: ``jax.distributed.initialize`` from config (TPU pods, GPU clusters, or several
CPU processes on one machine for tests)."""

from __future__ import annotations

from dataclasses import dataclass

import jax


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
