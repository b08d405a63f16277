"""`areal-jax train` across two processes joined by jax.distributed (two fake CPU devices each, one
global fsdp mesh of four): process 0 owns rollout, the controller, evaluation and the metrics and
hands each step's batch to process 1; both train it, join the weight gathers, save the
checkpoint and write the export together."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests import xla_flags
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


QUICK = ["log.progress=false", "data.size=300", "data.eval_size=8", "batch_size=2", "rollout.group_size=4",
         "rollout.max_new_tokens=4", "rollout.filter_uniform_reward=false", "reward.num_workers=1", "mesh.fsdp=-1",
         "distributed.num_processes=2"]


def _run_two(run_dir: Path, overrides: list[str], timeout: float) -> tuple[list[int], list[str]]:
    """``areal-jax train`` as processes 0 and 1 of one jax.distributed job (two CPU devices
    each); returns their exit codes and output."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags.devices(2)}  # three steps: the processes mostly compile
    args = ["--config", str(DEMO), "--log-level", "info", f"run_dir={run_dir}", *QUICK,
            f"distributed.coordinator_address=127.0.0.1:{port}", *overrides]
    procs = [subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", *args, f"distributed.process_id={i}"],
                              env=env, cwd=run_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process run timed out:\n" + "\n---\n".join(logs))
    return [p.returncode for p in procs], logs


@pytest.mark.slow
def test_two_process_run_trains_process_zeros_batches_everywhere(tmp_path: Path) -> None:
    codes, logs = _run_two(tmp_path, ["steps=3", "warm_start.steps=3", "checkpoint.every_steps=2"], timeout=420)
    assert codes == [0, 0], "\n---\n".join(logs)[-6000:]

    # Process 0 alone wrote the metrics: each step once, with the weights pushed to its server.
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["served_versions"] for m in metrics] == [["1"], ["2"], ["3"]]
    assert "warm start: 3 supervised steps" in logs[0] and "held-out accuracy before RL" in logs[0]
    assert "rollout:" not in logs[1] and "held-out accuracy" not in logs[1]  # no rollout, no evaluation there

    # Process 1 trained exactly process 0's batches, step by step.
    trained = {int(m.group(1)): m.group(2) for m in
               re.finditer(r"process 1: step (\d+) trained 8 trajectories of prompts (\[.*?\])", logs[1])}
    assert trained == {m["step"]: str(m["prompt_ids"]) for m in metrics}

    # The checkpoints (steps 2 and 3) and the export were written by both processes together.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    writers = set()
    for shard in (tmp_path / "final").glob("*.safetensors"):
        with safe_open(shard, "np") as f:
            writers.add(f.metadata()["written_by_process"])
    assert writers == {"0", "1"}
    index = json.loads((tmp_path / "final" / "model.safetensors.index.json").read_text())
    assert "model.embed_tokens.weight" in index["weight_map"]


@pytest.mark.slow
def test_a_step_that_fails_everywhere_ends_both_processes_with_the_error(tmp_path: Path) -> None:
    """Every trajectory is longer than train.max_seq_len, so the first train step raises on both
    processes: both exit (non-zero) instead of one waiting for the other, and process 0 names
    the error."""
    codes, logs = _run_two(tmp_path, ["steps=2", "warm_start=null", "train.max_seq_len=8"],
                           timeout=240)
    assert codes[0] != 0 and codes[1] != 0, logs
    assert "more than TrainConfig.max_seq_len=8" in logs[0]
    assert "process 0 ended the run" in logs[1] and "train failed" in logs[1]
