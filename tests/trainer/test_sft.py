"""The supervised warm start: the same steps on one device and on a mesh, with the batch's rows
split over the mesh's batch axes."""

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from areal_jax.models import load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from areal_jax.trainer.sft import SFTConfig, _batch_placer, pad_batch, warm_start
from sharding import MeshConfig, make_mesh


def _examples(n: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(0)
    return [(list(rng.integers(3, 90, rng.integers(3, 8))), list(rng.integers(3, 90, rng.integers(2, 6))))
            for _ in range(n)]


def test_warm_start_on_a_mesh_matches_one_device_and_splits_the_rows(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", size="tiny")
    cfg = SFTConfig(steps=4, batch_size=16, lr=3e-3, warmup_steps=1, max_len=16)
    examples = _examples(40)
    single = load_pretrained(ckpt)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4, tensor=1), jax.devices()[:8])
    sharded = load_pretrained(ckpt, mesh=mesh)

    place = _batch_placer(nnx.state(sharded, nnx.Param))
    batch = place(pad_batch(examples[:16], 16))
    ids = batch["input_ids"]
    assert ids.sharding.shard_shape(ids.shape) == (2, 16)  # 16 rows over data x fsdp = 8 ways
    odd = place(pad_batch(examples[:6], 16))["input_ids"]  # 6 rows do not split 8 ways: replicated
    assert odd.sharding.shard_shape(odd.shape) == (6, 16)

    a = warm_start(single, cfg, None, [], examples=examples)
    b = warm_start(sharded, cfg, None, [], examples=examples)
    np.testing.assert_allclose([a["loss_first"], a["loss_last"]], [b["loss_first"], b["loss_last"]], rtol=1e-5)
    for (path, x), (_, y) in zip(nnx.to_flat_state(nnx.state(single, nnx.Param)),
                                 nnx.to_flat_state(nnx.state(sharded, nnx.Param)), strict=True):
        # The key bias adds nearly the same q.b to every score of a query (exactly the same before
        # RoPE), which the softmax cancels: its gradient is mostly rounding, whose summation order
        # differs between one device and eight, and Adam's normalised step turns that into up to
        # lr a step. 1e-5 is 0.1% of how far 4 steps move it; a sharding error moves it by ~lr.
        atol = 1e-5 if path[-2:] == ("k_proj", "bias") else 2e-6
        np.testing.assert_allclose(np.asarray(x.get_value()), np.asarray(y.get_value()), atol=atol, err_msg=str(path))
