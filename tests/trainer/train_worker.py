"""One process of the two-process train test: join through jax.distributed (two CPU devices per
process), run ``multihost_flow.run`` on the global mesh and (process 0) save what it returns.

Usage: python train_worker.py PROCESS_ID PORT OUT_NPZ ESTIMATOR
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

from sharding import DistributedConfig, initialize_distributed, make_mesh  # noqa: E402
from tests.trainer.multihost_flow import MESH, run  # noqa: E402


def main() -> None:
    pid, port, out, estimator = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                             process_id=pid))
    assert jax.process_count() == 2 and len(jax.local_devices()) == 2
    results = run(make_mesh(MESH), estimator)
    if pid == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
