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

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


@pytest.mark.slow
def test_two_process_run_trains_process_zeros_batches_everywhere(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    args = ["--config", str(DEMO), "--log-level", "info", f"run_dir={tmp_path}", "steps=3", "log.progress=false",
            "data.size=300", "data.eval_size=8", "batch_size=2", "rollout.group_size=4", "rollout.max_new_tokens=4",
            "rollout.filter_uniform_reward=false", "reward.num_workers=1", "warm_start.steps=3",
            "checkpoint.every_steps=2", "mesh.fsdp=-1", f"distributed.coordinator_address=127.0.0.1:{port}",
            "distributed.num_processes=2"]
    procs = [subprocess.Popen([sys.executable, "-m", "areal_jax.cli", "train", *args, f"distributed.process_id={i}"],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process run timed out:\n" + "\n---\n".join(logs))
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(logs)[-6000:]

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
