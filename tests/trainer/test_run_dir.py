"""A run directory on an object store (``gs://``) with no shared filesystem: the path layer's
upload and download, and a whole run (warm start, checkpoints, kill-free resume on a fresh
host, export) against a stand-in bucket served through fsspec (``tests/trainer/fake_gs.py``)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.trainer.run_dir import RunDir, local_run_dir
from tests import xla_flags
from tests.trainer.helpers import NO_EVAL

ROOT = Path(__file__).resolve().parents[2]


def test_a_local_run_dir_is_its_own_working_dir_and_publishes_nothing(tmp_path: Path) -> None:
    files = RunDir(tmp_path / "run")
    assert not files.remote and files.local == tmp_path / "run" and files.path("final") == tmp_path / "run" / "final"
    assert files.publish() == [] and files.fetch("metrics.jsonl") is None


def test_a_url_run_dir_uploads_and_downloads_files_and_trees(tmp_path: Path) -> None:
    import fsspec

    files = RunDir("memory://bucket/runs/r1/", local_dir=str(tmp_path / "host-a"))
    assert files.remote and files.local == tmp_path / "host-a" and files.path("final") == "memory://bucket/runs/r1/final"
    (files.local / "tensorboard" / "sub").mkdir(parents=True)
    (files.local / "tensorboard" / "sub" / "events.1").write_bytes(b"\x00ev")
    (files.local / "metrics.jsonl").write_text('{"step": 1}\n')
    assert files.publish() == ["metrics.jsonl", "tensorboard"]  # no config.yaml, curves.png or logs yet
    fs = fsspec.filesystem("memory")
    assert fs.cat_file("/bucket/runs/r1/tensorboard/sub/events.1") == b"\x00ev"

    other = RunDir("memory://bucket/runs/r1", local_dir=str(tmp_path / "host-b"))  # another host
    assert other.fetch("metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (other.fetch("tensorboard") / "sub" / "events.1").read_bytes() == b"\x00ev"
    assert other.fetch("warm_start") is None
    other.remove("tensorboard")
    assert not fs.exists("/bucket/runs/r1/tensorboard") and fs.exists("/bucket/runs/r1/metrics.jsonl")
    assert local_run_dir("gs://b/runs/r 1").parts[-3:] == ("areal-jax", "runs", "b_runs_r_1")


def _cli(buckets: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # one device, as a laptop; compiled fast: two one-step runs, mostly compiling (the programs
    # are then the ones other one-device runs of the suite compile, so the cache shares them)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags.FAST_COMPILE}
    return subprocess.run([sys.executable, "-m", "tests.trainer.fake_gs", str(buckets), "train", *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_run_on_gs_with_no_shared_filesystem_resumes_on_a_fresh_host(tmp_path: Path) -> None:
    """``run_dir: gs://...`` with the in-process engine: the config, metrics, TensorBoard events, plot,
    warm-started and exported policies reach the bucket; the host's working directory is
    then deleted, and a resumed run (on a "fresh host") takes the metrics and the warm start
    from the bucket, continues from the checkpoint and adds its steps."""
    buckets, cwd = tmp_path / "buckets", tmp_path / "cwd"
    cwd.mkdir()
    bucket = buckets / "bkt" / "runs" / "r1"
    common = ["--config", str(ROOT / "configs" / "demo.yaml"), "run_dir=gs://bkt/runs/r1",
              f"local_dir={tmp_path / 'host'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every_steps=1",
              "warm_start.steps=2", "data.size=300", *NO_EVAL, "eval.every=0", "batch_size=2",
              "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.filter_uniform_reward=false",
              "rollout.backend=local", "rollout.mode=sync", "reward.num_workers=1", "log.progress=false",
              "train.micro_batch_tokens=128", "train.length_buckets=[128]"]
    first = _cli(buckets, [*common, "steps=1", "export=false"], cwd)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert sorted(p.name for p in bucket.iterdir()) == ["config.yaml", "curves.png", "metrics.jsonl", "tensorboard",
                                                         "warm_start"]
    assert (bucket / "warm_start" / "config.json").exists() and list((bucket / "warm_start").glob("*.safetensors"))
    assert [json.loads(line)["step"] for line in (bucket / "metrics.jsonl").read_text().splitlines()] == [1]
    assert list(cwd.iterdir()) == []  # nothing took the URL for a local path

    shutil.rmtree(tmp_path / "host")  # a fresh host: only the bucket and the checkpoints remain
    second = _cli(buckets, [*common, "steps=2", "--resume"], cwd)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    assert "resuming from checkpoint step 1 " in second.stdout
    lines = [json.loads(line) for line in (bucket / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and [m["version"] for m in lines] == [1, 2]
    assert (bucket / "final" / "config.json").exists() and list((bucket / "final").glob("*.safetensors"))
    assert list(cwd.iterdir()) == []
