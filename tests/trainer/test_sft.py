"""The supervised warm start: the same steps on one device and on a mesh, with the batch's rows
split over the mesh's batch axes; through the trainer's Learner, its loss is the whole-logits
cross-entropy and the model keeps its dtypes."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from areal_jax.trainer.sft import SFTConfig, pad_batch, place_rows, sft_loss, warm_start
from sharding import MeshConfig, logical_to_sharding, make_mesh


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

    split = logical_to_sharding(("batch", "length"), mesh)
    ids = place_rows(pad_batch(examples[:16], 16), split, 8)["input_ids"]
    assert ids.sharding.shard_shape(ids.shape) == (2, 16)  # 16 rows over data x fsdp = 8 ways
    odd = place_rows(pad_batch(examples[:6], 16), split, 8)  # 6 rows padded to 8 with empty ones
    assert odd["input_ids"].shape == (8, 16) and odd["input_ids"].sharding.shard_shape((8, 16)) == (1, 16)
    assert not np.asarray(odd["loss_mask"])[6:].any() and not np.asarray(odd["segment_ids"])[6:].any()

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


def test_warm_start_loss_is_the_answer_cross_entropy_and_dtypes_stay(tmp_path: Path) -> None:
    """The first step's loss (learning rate 0 at the warmup's start) is ``sft_loss`` of the whole
    batch from whole logits; a bfloat16 model trains through float32 masters and comes back
    bfloat16, its weights moved."""
    ckpt = make_tiny_checkpoint(tmp_path / "tiny", size="tiny")
    examples = _examples(8)
    model = load_pretrained(ckpt, dtype="bfloat16")
    before = [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    batch = {k: jnp.asarray(v) for k, v in pad_batch(examples, 16).items()}
    expected = float(sft_loss(_float32(model), batch))
    stats = warm_start(model, SFTConfig(steps=3, batch_size=8, lr=1e-2, warmup_steps=1, max_len=16), None, [],
                       examples=examples)
    # The batch is all 8 examples (in another order, which the mean ignores); float32 compute on CPU.
    assert stats["loss_first"] == pytest.approx(expected, rel=1e-5)
    assert stats["skipped_steps"] == 0 and stats["loss_last"] < stats["loss_first"]
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(x.dtype == jnp.bfloat16 for x in after)
    assert max(float(np.abs(np.asarray(x, np.float32) - b).max()) for x, b in zip(after, before, strict=True)) > 1e-3


def _float32(model: object) -> object:
    """``model``'s weights in a float32 model (the numerics the warm start computes in on CPU)."""
    from areal_jax.models import Decoder

    twin = Decoder(model.config.replace(param_dtype="float32", dtype="float32"), rngs=nnx.Rngs(0))
    nnx.update(twin, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model)))
    return twin


def test_warm_start_schedule_cosine_decays_to_zero_and_a_bad_name_is_refused() -> None:
    """``warm_start.schedule``: constant holds ``lr`` after the warmup; cosine follows
    lr * (1 + cos(pi * t / T)) / 2 over the steps after it and ends at 0, so the last batches
    no longer decide where the weights land. An unknown name is a config error naming the key."""
    from areal_jax.config import ConfigError, from_dict
    from areal_jax.trainer.run_config import RunConfig
    from areal_jax.trainer.sft import lr_schedule

    steps, warmup, lr = 50, 10, 3e-3
    constant = lr_schedule(SFTConfig(steps=steps, warmup_steps=warmup, lr=lr))
    cosine = lr_schedule(SFTConfig(steps=steps, warmup_steps=warmup, lr=lr, schedule="cosine"))
    t = np.arange(steps + 1)
    ramp = lr * np.minimum(t, warmup) / warmup
    after = lr * (1 + np.cos(np.pi * np.clip(t - warmup, 0, steps - warmup) / (steps - warmup))) / 2
    np.testing.assert_allclose([float(constant(i)) for i in t], np.where(t < warmup, ramp, lr), rtol=1e-6)
    np.testing.assert_allclose([float(cosine(i)) for i in t], np.where(t < warmup, ramp, after), rtol=1e-5,
                               atol=1e-9)
    assert float(cosine(steps - 1)) < 0.01 * lr
    with pytest.raises(ConfigError, match="warm_start.schedule='cos'.*constant, cosine"):
        from_dict(RunConfig, {"warm_start": {"schedule": "cos"}})
