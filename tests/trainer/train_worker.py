"""One process of the two-process train test: join through jax.distributed (two CPU devices per
process), run ``multihost_flow.run`` on the global mesh for each estimator given, one after the
other in the same pair of processes, and (process 0) save what each returns to
``OUT_DIR/<estimator>.npz``. An estimator named ``<estimator>@split`` trains on part of the
devices only, each process's first (``multihost_flow.split_mesh``), as beside an engine on the rest.

Usage: python train_worker.py PROCESS_ID PORT OUT_DIR ESTIMATOR[,ESTIMATOR...]
"""

from tests.sharding.two_process import join  # first: it sets XLA's flags

# isort: split

from pathlib import Path

import jax
import numpy as np

from sharding import make_mesh
from tests.trainer.multihost_flow import MESH, run, split_mesh


def main() -> None:
    pid, (out, estimators) = join()
    assert jax.process_count() == 2 and len(jax.local_devices()) == 2
    for estimator in estimators.split(","):
        name, _, where = estimator.partition("@")
        results = run(split_mesh() if where == "split" else make_mesh(MESH), name)
        if pid == 0:
            np.savez(Path(out) / f"{estimator}.npz", **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
