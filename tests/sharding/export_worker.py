"""One process of the two-process export test: join through jax.distributed, load a model onto
the global mesh (fsdp 2 x tensor 2 over both processes), and save it as a HF directory.

Usage: python export_worker.py PROCESS_ID PORT MODEL_DIR OUT_DIR
"""

from tests.sharding.two_process import join  # first: it sets XLA's flags

# isort: split

import jax

from areal_jax.models import load_pretrained, save_pretrained
from sharding import MeshConfig, make_mesh


def main() -> None:
    _, (model_dir, out) = join()
    model = load_pretrained(model_dir, mesh=make_mesh(MeshConfig(data=1, fsdp=2, tensor=2)))
    assert not all(v.is_fully_addressable for v in jax.tree.leaves(model))  # spread over both processes
    print("saved:", save_pretrained(model, out, max_shard_bytes=8 * 1024))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
