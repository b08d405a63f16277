"""The start of one process of a two-process test (``test_multihost.py`` runs each worker as
processes 0 and 1): two fake CPU devices, then a join through ``jax.distributed``. Import it
before jax: it sets XLA's flags."""

import os
import sys

from tests import xla_flags

os.environ["XLA_FLAGS"] = xla_flags.devices(2)
os.environ["JAX_PLATFORMS"] = "cpu"


def join() -> tuple[int, list[str]]:
    """Join as process ``argv[1]`` of two, through the coordinator at 127.0.0.1:``argv[2]``;
    returns this process's id and the worker's own arguments (``argv[3:]``)."""
    from sharding import DistributedConfig, initialize_distributed

    pid, port = int(sys.argv[1]), sys.argv[2]
    initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                             process_id=pid))
    return pid, sys.argv[3:]
