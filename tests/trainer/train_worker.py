"""One process of the two-process train test: join through jax.distributed (two CPU devices per
process), run ``multihost_flow.run`` on the global mesh and (process 0) save what it returns.

Usage: python train_worker.py PROCESS_ID PORT OUT_NPZ ESTIMATOR
"""

from tests.sharding.two_process import join  # first: it sets XLA's flags

# isort: split

import jax
import numpy as np

from sharding import make_mesh
from tests.trainer.multihost_flow import MESH, run


def main() -> None:
    pid, (out, estimator) = join()
    assert jax.process_count() == 2 and len(jax.local_devices()) == 2
    results = run(make_mesh(MESH), estimator)
    if pid == 0:
        np.savez(out, **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
