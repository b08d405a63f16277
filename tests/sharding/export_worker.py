"""One process of the two-process export test: join through jax.distributed, load a model onto
the global mesh (fsdp 2 x tensor 2 over both processes), and save it as a HF directory.

Usage: python export_worker.py PROCESS_ID PORT MODEL_DIR OUT_DIR
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

from areal_jax.models import load_pretrained, save_pretrained  # noqa: E402
from sharding import DistributedConfig, MeshConfig, initialize_distributed, make_mesh  # noqa: E402


def main() -> None:
    pid, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                             process_id=pid))
    model = load_pretrained(model_dir, mesh=make_mesh(MeshConfig(data=1, fsdp=2, tensor=2)))
    assert not all(v.is_fully_addressable for v in jax.tree.leaves(model))  # spread over both processes
    print("saved:", save_pretrained(model, out, max_shard_bytes=8 * 1024))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
