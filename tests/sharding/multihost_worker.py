"""One process of the two-process test: join through jax.distributed, build the global mesh,
run a sharded forward and gradient, and (process 0) save the gathered results.

Usage: python multihost_worker.py PROCESS_ID PORT MODEL_DIR OUT_NPZ
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from areal_jax.models import load_pretrained, logprobs_from_logits  # noqa: E402
from sharding import (  # noqa: E402
    DistributedConfig,
    MeshConfig,
    activate,
    initialize_distributed,
    logical_to_sharding,
    make_mesh,  # noqa: E402
)


def main() -> None:
    pid, port, model_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    initialize_distributed(DistributedConfig(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                             process_id=pid))
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2))
    model = load_pretrained(model_dir, mesh=mesh)
    ids_host = np.random.default_rng(0).integers(0, 96, (4, 16)).astype(np.int32)
    sharding = logical_to_sharding(("batch", "length"), mesh)
    ids = jax.make_array_from_callback(ids_host.shape, sharding, lambda idx: ids_host[idx])
    graphdef, state = nnx.split(model)

    def loss_fn(state, ids):
        m = nnx.merge(graphdef, state)
        return -jnp.mean(logprobs_from_logits(m(ids)[:, :-1], ids[:, 1:]))

    with activate(mesh):
        logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, ids)
        loss, grads = jax.jit(jax.value_and_grad(loss_fn))(state, ids)
    gathered = {"logits": multihost_utils.process_allgather(logits, tiled=True), "loss": np.asarray(loss)}
    for path, g in nnx.to_flat_state(grads):
        gathered["grad/" + "/".join(map(str, path))] = multihost_utils.process_allgather(g.get_value(), tiled=True)
    if pid == 0:
        np.savez(out, **gathered)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
