"""`areal-jax train` across two processes joined by jax.distributed (two fake CPU devices each, one
global fsdp mesh of four): process 0 owns rollout, the controller, evaluation and the metrics and
hands each step's batch to process 1; both train it, join the weight gathers (pushes overlapped
with the next update and held, as on one host), save the checkpoint, are killed, resume from it
and write the export together. With ``rollout.backend: local`` each process also serves an
engine on its own devices and stages every pushed version into it."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open

from tests import xla_flags
from tests.ports import free_port
from tests.trainer.helpers import NO_EVAL

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


QUICK = ["log.progress=false", "data.size=300", "data.eval_size=8", "batch_size=2", "rollout.group_size=4",
         "rollout.max_new_tokens=4", "rollout.filter_uniform_reward=false", "reward.num_workers=1", "mesh.fsdp=-1",
         "distributed.num_processes=2"]


def _start_two(tmp: Path, run_dir: str | Path, overrides: list[str], *extra: str,
               buckets: Path | None = None) -> list[subprocess.Popen]:
    """``areal-jax train`` as processes 0 and 1 of one jax.distributed job (two CPU devices
    each), their output in ``tmp/proc<i>.log``; with ``buckets``, ``gs://`` is served from there
    (``fake_gs.py``)."""
    port = free_port()
    # Short runs, mostly compiling: the suite's compilation cache (tests/conftest.py, inherited)
    # lets a resumed run reuse the first one's programs.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags.devices(2)}
    args = ["--config", str(DEMO), "--log-level", "info", f"run_dir={run_dir}", *QUICK,
            f"distributed.coordinator_address=127.0.0.1:{port}", *overrides]
    cli = ["areal_jax.cli"] if buckets is None else ["tests.trainer.fake_gs", str(buckets)]
    (tmp / "cwd").mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([sys.executable, "-m", *cli, "train", *args, f"distributed.process_id={i}", *extra],
                             env=env, cwd=tmp / "cwd", stdout=(tmp / f"proc{i}.log").open("w"),
                             stderr=subprocess.STDOUT) for i in range(2)]


def _wait_two(procs: list[subprocess.Popen], tmp: Path, timeout: float) -> tuple[list[int], list[str]]:
    """Their exit codes and output; both killed, and the test failed, after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process run timed out:\n" + "\n---\n".join(_logs(tmp))[-6000:])
    return [p.returncode for p in procs], _logs(tmp)


def _logs(tmp: Path) -> list[str]:
    return [(tmp / f"proc{i}.log").read_text() for i in range(2)]


def _run_two(tmp: Path, overrides: list[str], timeout: float) -> tuple[list[int], list[str]]:
    return _wait_two(_start_two(tmp, tmp / "run", overrides), tmp, timeout)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _complete(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.exists() else []


def _trained_by_process_1(log: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in
            re.finditer(r"process 1: step (\d+) trained 8 trajectories of prompts (\[.*?\])", log)}


@pytest.mark.slow
def test_two_process_run_on_gs_pushes_overlapped_is_killed_and_resumes(tmp_path: Path) -> None:
    """Asynchronous, pushes overlapped with the next update and held (sent before the pause): both
    processes train process 0's batches (process 1 receiving its own rows' share of each), the
    gathers of a push in flight never cross a train step's collectives (a mismatch would hang or
    corrupt the run). The run directory is ``gs://`` (a stand-in bucket) and each process has
    its own working directory: nothing is shared but the bucket and the checkpoints (orbax's own
    storage). SIGKILL both once step 3 is logged after the step-2 checkpoint and delete their
    working directories (fresh hosts); the resumed pair goes on from step 2, the prompts in
    flight there first, trains no prompt twice, and ends with the export written to the bucket
    by both."""
    buckets, host = tmp_path / "buckets", tmp_path / "host"
    bucket = buckets / "bkt" / "runs" / "r1"
    ckpt_dir = tmp_path / "ckpt"
    steps = 4
    overrides = [f"steps={steps}", "warm_start.steps=3", "checkpoint.every_steps=2", "eval.every=0",
                 f"local_dir={host}", f"checkpoint.dir={ckpt_dir}"]
    procs = _start_two(tmp_path, "gs://bkt/runs/r1", overrides, buckets=buckets)
    local_metrics = host / "process-0"
    deadline = time.monotonic() + 480
    while not (len(_metrics(local_metrics)) >= 3 and 2 in _complete(ckpt_dir)):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            pytest.fail("the first run ended or stalled before the kill:\n" + "\n---\n".join(_logs(tmp_path))[-6000:])
        time.sleep(0.05)
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    killed, first_logs = _metrics(local_metrics), _logs(tmp_path)
    assert 3 <= len(killed) < steps and _complete(ckpt_dir)[-1] == 2
    # Each process built its own base model and kept its files apart; the bucket got the config,
    # the warm start (written by both) and the metrics up to the checkpoint.
    assert all((host / f"process-{i}" / "base" / "config.json").exists() for i in range(2))
    assert not (host / "process-1" / "metrics.jsonl").exists()
    assert (bucket / "config.yaml").exists() and (bucket / "warm_start" / "config.json").exists()
    assert [m["step"] for m in _metrics(bucket)] == [1, 2]
    # Process 0 said how it pushes; process 1 trained exactly its batches, step by step.
    assert ("weight push: overlapped with the next update, held (sent while rollout generates, swapped in "
            "within one pause), gathered across 2 processes onto process 0's host") in first_logs[0]
    assert "warm start: 3 supervised steps" in first_logs[0] and "held-out accuracy before RL" in first_logs[0]
    assert "rollout:" not in first_logs[1] and "held-out accuracy" not in first_logs[1]  # no rollout there
    assert {k: v for k, v in _trained_by_process_1(first_logs[1]).items() if k <= len(killed)} == \
        {m["step"]: str(m["prompt_ids"]) for m in killed}
    # ... receiving of each batch only the tokens of the rows its two devices hold (of the four).
    shares = re.findall(r"process 1: step (\d+): (\d+) of 8 trajectories its own, (\d+) of (\d+) token bytes received",
                        first_logs[1])
    assert len(shares) >= len(killed) and all(0 < int(k) < 8 and int(got) < int(whole) * 3 // 4
                                              for _, k, got, whole in shares), shares

    from etils import epath

    from areal_jax.trainer.checkpoint import CheckpointConfig, RunCheckpoints

    ckpts = RunCheckpoints(CheckpointConfig(), epath.Path(ckpt_dir))
    pending = ckpts.read_meta(2)["controller"]["pending"]
    ckpts.close()
    shutil.rmtree(host)  # fresh hosts: the bucket and the checkpoints are all that is left
    codes, logs = _wait_two(_start_two(tmp_path, "gs://bkt/runs/r1", overrides, "--resume", buckets=buckets),
                            tmp_path, 480)
    assert codes == [0, 0], "\n---\n".join(logs)[-6000:]
    assert "resuming from checkpoint step 2 " in logs[0]
    lines = _metrics(bucket)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["version"] for m in lines] == list(range(1, steps + 1))
    assert lines[:2] == killed[:2]  # the lines up to the checkpoint kept as they were
    # Every push landed, the last before the run ended; a push in flight shows the version before
    # (the warm start is version 0: the servers, started on the base model, load it as version 0
    # before anything is generated).
    assert lines[-1]["served_versions"] == [str(steps)]
    assert all(m["served_versions"] in ([str(m["step"])], [str(m["step"] - 1)]) for m in lines), \
        [(m["step"], m["served_versions"]) for m in lines]
    trained = Counter(p for m in lines for p in m["prompt_ids"])
    assert max(trained.values()) == 1  # as one unbroken run: every prompt once
    # The prompts in flight at the checkpoint are submitted again first (two steps of two prompts
    # may not reach all of them; the single-process resume test follows every one).
    assert pending and set(pending) & {p for m in lines[2:] for p in m["prompt_ids"]}
    assert _trained_by_process_1(logs[1]) == {m["step"]: str(m["prompt_ids"]) for m in lines[2:]}

    # The checkpoints (steps 2 and 4) and the export were written by both processes together.
    assert _complete(ckpt_dir) == [2, 4]
    writers = set()
    for shard in (bucket / "final").glob("*.safetensors"):
        with safe_open(shard, "np") as f:
            writers.add(f.metadata()["written_by_process"])
    assert writers == {"0", "1"}
    index = json.loads((bucket / "final" / "model.safetensors.index.json").read_text())
    assert "model.embed_tokens.weight" in index["weight_map"]
    assert (bucket / "tensorboard").is_dir() and (bucket / "curves.png").exists()
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing took the URL for a local path


@pytest.mark.slow
def test_a_step_that_fails_everywhere_ends_both_processes_with_the_error(tmp_path: Path) -> None:
    """Every trajectory is longer than train.max_seq_len, so the first train step raises on both
    processes: both exit (non-zero) instead of one waiting for the other, and process 0 names
    the error. The batch comes from an engine on each host sharing its devices with the trainer
    (``rollout.backend: local``, shared placement): each process stops its engine on the way out."""
    codes, logs = _run_two(tmp_path, ["steps=2", "warm_start=null", "train.max_seq_len=8", "rollout.backend=local",
                                      *NO_EVAL], timeout=240)
    assert codes[0] != 0 and codes[1] != 0, logs
    assert "rollout: an engine on each of 2 hosts (shared placement" in logs[0]
    assert "more than TrainConfig.max_seq_len=8" in logs[0]
    assert "process 0 ended the run" in logs[1] and "train failed" in logs[1]
    assert all(f"process {i}: its engine sampled" in log for i, log in enumerate(logs))


@pytest.mark.slow
def test_the_in_process_engine_runs_on_every_host_and_each_serves_every_pushed_version(tmp_path: Path) -> None:
    """``rollout.backend: local``, placement ``split``, on two processes: the trainer's mesh is
    one device of each process, and each process builds an engine on its other device and
    serves it over HTTP; process 0 routes over both, and every push is staged by each process
    from its own gathers and committed on both engines as one version. Asynchronous with
    ``max_staleness`` 0, so a trained token was sampled by the version that trains on it: its
    behaviour logprob must equal the trainer's recompute up to float32 rounding. The reward (the
    answer's length) differs within a group, so the weights move: with process 1's engine
    swapping in its old weights under the new label at each commit, the importance weight
    reached 1.40 at step 2, against 1 + 5e-7 here (the same figures as with the shared
    placement). Each engine sampled tokens under the starting weights and under both pushed
    versions (the last through the final evaluation)."""
    import ast

    codes, logs = _run_two(tmp_path, ["steps=2", "warm_start=null", "rollout.backend=local",
                                      "rollout.local.placement=split", "rollout.max_staleness=0", "train.lr=0.01",
                                      "reward.name=tests.rewards.fns:echo"], timeout=300)
    assert codes == [0, 0], "\n---\n".join(logs)[-6000:]
    assert "rollout: an engine on each of 2 hosts (split placement" in logs[0]
    assert "staged by each of 2 processes into its own host's engine" in logs[0]
    # Each engine's weights on its host's second device (the first is the trainer's): process 0's
    # is global device 1, process 1's one of its own.
    engines = [json.loads(re.search(rf"process {i}: serving its engine \(weights on devices (\[.*?\])", log).group(1))
               for i, log in enumerate(logs)]
    assert engines[0] == [1] and len(engines[1]) == 1 and engines[1][0] > 1, engines
    lines = _metrics(tmp_path / "run")
    assert [m["version"] for m in lines] == [1, 2]
    assert lines[-1]["served_versions"] == ["2", "2"]
    for m in lines:  # exp(recomputed - behaviour) per token: 1 up to float32 rounding of two forwards
        assert abs(m["behavior_imp_weight_max"] - 1) < 1e-4 and m["behavior_kl"] < 1e-6, m
    for i, log in enumerate(logs):
        sampled = ast.literal_eval(re.search(rf"process {i}: its engine sampled (\{{.*?\}})", log).group(1))
        assert all(sampled.get(label, 0) > 0 for label in ("default", "1", "2")), (i, sampled)
        assert "serving weights '2' (update 2; held weights swapped" in log

