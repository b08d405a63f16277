"""Multi-host start: ``jax.distributed.initialize`` from config (TPU pods, GPU clusters, or several
CPU processes on one machine for tests), reading an array sharded over processes back whole, and
putting a host value every process holds onto a sharding over several processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


@dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process JAX runtime (every host of a TPU pod slice or GPU
    cluster runs one process); the default is a single process that joins nothing."""

    coordinator_address: str | None = None
    """host:port of process 0; None lets JAX discover it (TPU pods, Slurm, Open MPI)."""
    num_processes: int | None = 1
    """Processes in the run. 1 (and no ``coordinator_address``): a single process, nothing to
    join. None: JAX discovers the cluster, as on a TPU pod where every worker runs the same
    command."""
    process_id: int | None = None
    """This process's index; None lets JAX discover it."""
    local_device_ids: list[int] | None = None
    """Restrict this process to some local accelerators (a GPU host split between jobs)."""
    cpu_collectives: str = "gloo"
    """Collectives implementation for the CPU backend (multi-process tests): gloo or mpi."""

    def __post_init__(self) -> None:
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1 or null (discover), got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None \
                and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"distributed.process_id={self.process_id} is outside 0..{self.num_processes - 1}")

    @property
    def multi_process(self) -> bool:
        return self.num_processes != 1 or self.coordinator_address is not None


def initialize_distributed(cfg: DistributedConfig) -> bool:
    """Join the multi-process runtime before any device is used; returns False (and does nothing)
    for a single process. Joining twice in one process (a second run from the same notebook) is
    a no-op."""
    if not cfg.multi_process:
        return False
    if jax.distributed.is_initialized():
        return True
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
    that passes ``fetch=False`` takes part without copying the result to its host (None), and
    returns once its part is done."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x)) if fetch else None
    if not isinstance(x.sharding, NamedSharding):
        from jax.experimental import multihost_utils

        full_host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return full_host if fetch else None
    full = jax.jit(lambda a: a, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
    if not fetch:
        # Finished before the caller's next collective (a barrier, a broadcast over every device),
        # which may share its communicator group with this one (see ``put_from_host``).
        full.block_until_ready()
        return None
    return np.asarray(full.addressable_data(0))


def put_from_host(tree: Any, sharding: NamedSharding) -> Any:
    """``tree``'s host values (NumPy arrays or scalars, the same on every process: a step counter,
    a batch's scalars) on ``sharding``, each process writing only its own devices' shards.

    Not ``jax.device_put``: onto a sharding over several processes it first checks that every
    process passed the same value, with an all-gather over every device of the run
    (``multihost_utils.assert_equal``). When the sharding's mesh is part of the devices (the
    trainer beside an engine, ``rollout.local.placement: split``), that all-gather shares a
    communicator group with the trainer's own collectives while the trainer's last step may
    still run; on XLA:CPU (gloo) the two programs then reached the group in different orders on
    two processes ("collective mismatch"). Here no collective runs at all."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def put(x: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree)
