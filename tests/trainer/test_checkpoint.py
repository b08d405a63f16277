"""Run checkpoints: the config section and directory paths, an asynchronous save that the next
(donating) update cannot spoil, a restore onto another mesh, and a disk that fills up mid-save."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from etils import epath

from areal_jax.config import ConfigError
from areal_jax.trainer.checkpoint import CheckpointConfig, RunCheckpoints, checkpoint_dir
from areal_jax.trainer.run_config import load_run_config
from tests import xla_flags

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


def test_config_section_is_type_checked() -> None:
    cfg = load_run_config(DEMO, ["checkpoint.every_steps=5", "checkpoint.every_seconds=60", "checkpoint.keep=2",
                                 "checkpoint.async_save=false", "checkpoint.dir=gs://bucket/runs/a"])
    c = cfg.checkpoint
    assert (c.every_steps, c.every_seconds, c.keep, c.async_save, c.dir) == (5, 60.0, 2, False, "gs://bucket/runs/a")
    assert load_run_config(DEMO).checkpoint.enabled  # on by default (every 30 minutes, and the last step)
    assert not load_run_config(DEMO, ["checkpoint.every_seconds=0"]).checkpoint.enabled
    with pytest.raises(ConfigError, match="did you mean 'every_steps'"):
        load_run_config(DEMO, ["checkpoint.every_step=5"])
    with pytest.raises(ConfigError, match="checkpoint.keep"):
        load_run_config(DEMO, ["checkpoint.keep=many"])
    with pytest.raises(ConfigError, match="keep must be >= 1"):
        load_run_config(DEMO, ["checkpoint.keep=0"])
    with pytest.raises(ConfigError, match="must be >= 0"):
        load_run_config(DEMO, ["checkpoint.every_steps=-1"])


def test_checkpoint_dir_keeps_urls_and_makes_local_paths_absolute(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert str(checkpoint_dir(CheckpointConfig(), "runs/x")) == str(tmp_path / "runs" / "x" / "checkpoints")
    assert str(checkpoint_dir(CheckpointConfig(dir="ck"), "runs/x")) == str(tmp_path / "ck")
    # A bucket URL stays a URL (orbax and etils write to it natively); nothing here touches storage.
    url = checkpoint_dir(CheckpointConfig(dir="gs://bucket/runs/a/"), "runs/x")
    assert str(url).startswith("gs://bucket/runs/a") and str(url / "5") == "gs://bucket/runs/a/5"
    assert isinstance(url, epath.Path) and not (tmp_path / "gs:").exists()
    assert str(checkpoint_dir(CheckpointConfig(), "gs://bucket/run/")) == "gs://bucket/run/checkpoints"


@pytest.mark.slow
def test_async_save_is_not_spoiled_by_the_next_update(tmp_path: Path) -> None:
    """The next train step donates the buffers a background save may still be writing from: the
    checkpoint holds the values at save time. (The critic's arrays: ``ckpt_worker``'s GAE trainers.)"""
    from areal_jax.algo import AlgoConfig
    from areal_jax.trainer import TrainConfig, Trainer
    from tests.trainer.helpers import random_trajectories, tiny_model

    def make() -> Trainer:
        return Trainer(tiny_model(seed=3), AlgoConfig(),
                       TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2), mesh=None)

    rng = np.random.default_rng(0)
    trainer = make()
    trainer.train_batch(random_trajectories(rng, 2, 4), 0)
    saved = jax.device_get(trainer.checkpoint_state())
    assert set(saved) == {"params", "opt_state"}
    ckpts = RunCheckpoints(CheckpointConfig(every_steps=1), epath.Path(tmp_path))
    blocked = ckpts.save(1, trainer.checkpoint_state(), {"trainer_step": trainer.policy.step})
    trainer.train_batch(random_trajectories(rng, 2, 4), 1)  # donates params and AdamW state
    ckpts.close()

    fresh = make()
    ckpts = RunCheckpoints(CheckpointConfig(every_steps=1), epath.Path(tmp_path))
    assert ckpts.latest_step() == 1
    fresh.load_checkpoint_state(ckpts.restore_state(1, fresh.checkpoint_state()), ckpts.read_meta(1)["trainer_step"])
    got = jax.device_get(fresh.checkpoint_state())
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)
    assert fresh.policy.step == 1 and trainer.policy.step == 2
    moved = jax.device_get(trainer.policy.params)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(saved["params"]),
                                                    strict=True))
    print(f"async save blocked {blocked * 1e3:.0f} ms")


def _worker(args: list[str], devices: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = xla_flags.devices(devices) if devices else xla_flags.FAST_COMPILE
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "tests.trainer.ckpt_worker", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
def test_restore_onto_another_mesh(tmp_path: Path) -> None:
    """Saved from fsdp 8, restored onto fsdp 4 x tensor 2: equal values, the target's shardings."""
    out = _worker(["reshard", str(tmp_path)], devices=8)
    assert out["devices"] == 8 and out["source_meshes"] == ["{'data': 1, 'fsdp': 8, 'tensor': 1}"]
    assert out["equal"] and out["same_sharding"] and out["step"] == 7
    assert out["meshes"] == ["{'data': 1, 'fsdp': 4, 'tensor': 2}"]
    assert out["tensor_split_leaves"] > out["leaves"] // 2  # kernels (and their moments) split over tensor


@pytest.mark.slow
@pytest.mark.parametrize("limit", [2048, 256 * 1024], ids=["metadata_write_fails", "array_write_fails"])
def test_a_full_disk_is_a_clear_error_and_the_last_checkpoint_survives(tmp_path: Path, limit: int) -> None:
    """Writes past a file-size limit fail with EFBIG, as on a full disk: while orbax writes its
    metadata (the blocking part), or the arrays (in the background). Either way the error names
    the directory and the last complete checkpoint, which a new manager finds and restores, with
    ``keep=1`` (the failed save must not have deleted it)."""
    out = _worker(["disk_full", str(tmp_path), str(limit)])
    assert out["error"] is not None
    assert f"could not write checkpoint step 2 to {tmp_path}" in out["error"]
    assert "File too large" in out["error"] and "step 1, is intact" in out["error"]
    assert out["latest"] == 1 and out["restored_sums"] == out["saved_sums"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # the half-written step 2 is gone


def test_a_fresh_run_keeps_an_unfinished_runs_checkpoints_and_replaces_a_finished_ones(tmp_path: Path) -> None:
    import jax.numpy as jnp

    from areal_jax.trainer.checkpoint import CheckpointError
    from areal_jax.trainer.rl import _open_checkpoints

    cfg = load_run_config(DEMO, [f"run_dir={tmp_path}", "checkpoint.every_steps=1", "steps=4"])
    directory = checkpoint_dir(cfg.checkpoint, cfg.run_dir)

    def save(step: int) -> None:
        ckpts = RunCheckpoints(cfg.checkpoint, directory)
        ckpts.save(step, {"x": jnp.full(3, float(step))}, {"step": step, "total_steps": 4})
        ckpts.close()

    save(2)  # a run killed after step 2 of 4
    with pytest.raises(CheckpointError, match=r"unfinished run \(step 2 of 4\): pass --resume"):
        _open_checkpoints(cfg, resume=False)
    ckpts, meta = _open_checkpoints(cfg, resume=True)
    assert meta["step"] == 2 and ckpts.latest_step() == 2
    ckpts.close()
    save(4)  # the run finished: a new run in the same directory starts afresh, as its metrics do
    ckpts, meta = _open_checkpoints(cfg, resume=False)
    assert meta is None and ckpts.latest_step() is None and not list(Path(str(directory)).iterdir())
    ckpts.close()
    ckpts, meta = _open_checkpoints(cfg, resume=True)  # nothing to resume: start at step 0
    assert meta is None
    ckpts.close()


def test_save_schedule(tmp_path: Path) -> None:
    import time

    by_steps = RunCheckpoints(CheckpointConfig(every_steps=3, every_seconds=0), epath.Path(tmp_path / "a"))
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9] and by_steps.due(4, last=True)
    by_time = RunCheckpoints(CheckpointConfig(every_seconds=0.2), epath.Path(tmp_path / "b"))
    assert not by_time.due(1)
    time.sleep(0.25)
    assert by_time.due(2)
    off = RunCheckpoints(CheckpointConfig(every_seconds=0), epath.Path(tmp_path / "c"))
    assert not off.due(3) and not off.due(4, last=True)
    for c in (by_steps, by_time, off):
        c.close()


def test_rng_state_round_trips_through_json() -> None:
    """The host RNG state a checkpoint stores (as JSON) brings back the same draws, cached Gaussian
    halves included (Python's ``gauss`` and NumPy's legacy normals each keep one)."""
    import random

    from areal_jax.trainer.checkpoint import rng_state, set_rng_state

    def draws() -> list[float]:
        return [random.random(), random.gauss(0, 1), random.randrange(10**9),
                *np.random.rand(3).tolist(), float(np.random.standard_normal()), int(np.random.randint(10**9))]

    before = random.getstate(), np.random.get_state()
    try:
        random.seed(1), np.random.seed(1)
        random.gauss(0, 1), np.random.standard_normal()  # each now holds a cached second value
        state = json.loads(json.dumps(rng_state()))  # as the checkpoint's meta stores it
        first = draws()
        assert draws() != first  # the draws move on by themselves
        set_rng_state(state)
        assert draws() == first
    finally:
        random.setstate(before[0])
        np.random.set_state(before[1])
