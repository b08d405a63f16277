"""One process of the two-process test: join through jax.distributed, build the global mesh,
run a sharded forward and gradient, and (process 0) save the gathered results.

Usage: python multihost_worker.py PROCESS_ID PORT MODEL_DIR OUT_NPZ
"""

from tests.sharding.two_process import join  # first: it sets XLA's flags

# isort: split

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from areal_jax.models import load_pretrained, logprobs_from_logits
from sharding import (
    MeshConfig,
    activate,
    logical_to_sharding,
    make_mesh,
)


def main() -> None:
    pid, (model_dir, out) = join()
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
