"""Child processes of ``test_checkpoint.py``: each needs a process of its own (its own device count,
or a file-size limit that must not reach the test runner).

``python -m tests.trainer.ckpt_worker reshard DIR``: on 8 fake devices, a trainer on fsdp 8 saves
its state; a trainer on fsdp 4 x tensor 2 restores it with its own shardings. Prints JSON.

``python -m tests.trainer.ckpt_worker disk_full DIR LIMIT``: saves step 1, lowers RLIMIT_FSIZE so
writes past LIMIT bytes fail with EFBIG (the disk "fills up"), saves a changed state as step 2, then
restores the newest checkpoint with a new manager and a new trainer. Prints JSON.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np


def _trainer(mesh_cfg: object = None):  # noqa: ANN202 - test helper
    """A GAE trainer: policy, critic and both AdamW states."""
    from areal_jax.algo import AlgoConfig
    from areal_jax.trainer import TrainConfig, Trainer
    from sharding import make_mesh
    from tests.trainer.helpers import tiny_model

    mesh = make_mesh(mesh_cfg) if mesh_cfg is not None else None
    return Trainer(tiny_model(seed=3), AlgoConfig(adv_estimator="gae"),
                   TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2), mesh=mesh)


def _randomize(trainer: object, seed: int) -> None:
    """Random values in every array of the trainer's state, on its shardings: a state no fresh
    trainer has (Adam's moments non-zero), without compiling a train step."""
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda x: jax.device_put(rng.standard_normal(x.shape).astype(x.dtype), x.sharding),
                         trainer.checkpoint_state())
    trainer.load_checkpoint_state(state, 7)


def _sums(state: object) -> list[float]:
    return [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(state)]


def reshard(directory: str) -> dict:
    from etils import epath

    from areal_jax.trainer.checkpoint import CheckpointConfig, RunCheckpoints
    from sharding import MeshConfig

    src = _trainer(MeshConfig(data=1, fsdp=8, tensor=1))
    _randomize(src, 0)
    saved = jax.device_get(src.checkpoint_state())
    ckpts = RunCheckpoints(CheckpointConfig(every_steps=1), epath.Path(directory))
    ckpts.save(1, src.checkpoint_state(), {"trainer_step": src.policy.step})
    ckpts.close()

    dst = _trainer(MeshConfig(data=1, fsdp=4, tensor=2))
    ckpts = RunCheckpoints(CheckpointConfig(every_steps=1), epath.Path(directory))
    like = dst.checkpoint_state()
    assert set(like) == {"params", "opt_state", "critic_params", "critic_opt_state"}
    dst.load_checkpoint_state(ckpts.restore_state(1, like), ckpts.read_meta(1)["trainer_step"])
    got = dst.checkpoint_state()
    equal = all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(got),
                                                                 strict=True))
    same_sharding = all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(like), jax.tree.leaves(got),
                                                               strict=True))
    meshes = {str(dict(x.sharding.mesh.shape)) for x in jax.tree.leaves(got)}
    split = sum(1 for x in jax.tree.leaves(got) if "tensor" in str(x.sharding.spec))
    return {"equal": equal, "same_sharding": same_sharding, "meshes": sorted(meshes), "tensor_split_leaves": split,
            "leaves": len(jax.tree.leaves(got)), "step": dst.policy.step, "devices": jax.device_count(),
            "source_meshes": sorted({str(dict(x.sharding.mesh.shape))
                                     for x in jax.tree.leaves(src.checkpoint_state())})}


def disk_full(directory: str, limit: str) -> dict:
    import resource
    import signal

    from etils import epath

    from areal_jax.trainer.checkpoint import CheckpointConfig, CheckpointSaveError, RunCheckpoints

    trainer = _trainer()
    _randomize(trainer, 0)
    ckpts = RunCheckpoints(CheckpointConfig(every_steps=1, keep=1), epath.Path(directory))
    ckpts.save(1, trainer.checkpoint_state(), {"trainer_step": trainer.policy.step})
    ckpts.wait()
    saved = _sums(trainer.checkpoint_state())
    _randomize(trainer, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    error = None
    try:
        ckpts.save(2, trainer.checkpoint_state(), {"trainer_step": trainer.policy.step})
        ckpts.wait()
    except CheckpointSaveError as e:
        error = str(e)
    # A new manager reads the directory afresh, as a resumed run does; a new trainer restores.
    fresh = RunCheckpoints(CheckpointConfig(every_steps=1, keep=1), epath.Path(directory))
    latest = fresh.latest_step()
    other = _trainer()
    other.load_checkpoint_state(fresh.restore_state(latest, other.checkpoint_state()),
                                fresh.read_meta(latest)["trainer_step"])
    return {"error": error, "saved_sums": saved, "latest": latest, "restored_sums": _sums(other.checkpoint_state())}

if __name__ == "__main__":
    print("RESULT " + json.dumps({"reshard": reshard, "disk_full": disk_full}[sys.argv[1]](*sys.argv[2:])), flush=True)
