"""Kill and resume, end to end: ``areal-jax train`` as a child process on a tiny synchronous run
with the in-process engine is killed with SIGKILL mid-step, resumed and killed again mid-save,
then resumed to the end. Each resume starts from the last complete checkpoint, and the run
trains, step by step, the prompts an unbroken run trains: none lost, none twice; metrics.jsonl
and TensorBoard hold every step once. An asynchronous run killed with prompts in flight at its
checkpoint trains each of them after the resume, and no prompt twice."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import xla_flags
from tests.trainer.test_metrics import _tensorboard_view

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
RUN = ["warm_start=null", "data.size=300", "data.eval_size=0", "eval.every=0", "batch_size=2",
       "rollout.group_size=2", "rollout.max_new_tokens=4", "rollout.filter_uniform_reward=false",
       "rollout.backend=local", "rollout.mode=sync", "reward.num_workers=1", "log.progress=false", "export=false",
       "train.micro_batch_tokens=128", "train.length_buckets=[128]", f"steps={STEPS}"]


def _env(cache: Path) -> dict[str, str]:
    # one device, as a user's laptop (compiled fast: short runs, mostly compiling)
    env = {**os.environ, "XLA_FLAGS": xla_flags.FAST_COMPILE}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # Compiled programs are shared between the runs: only the first one compiles.
    env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "areal_jax.cli", "train", "--config", str(ROOT / "configs" / "demo.yaml"),
            *RUN, f"run_dir={run_dir}", *extra]


def _lines(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _complete(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.exists() else []


def _half_written(ckpt_dir: Path) -> list[str]:
    return [p.name for p in ckpt_dir.iterdir() if "orbax-checkpoint-tmp" in p.name] if ckpt_dir.exists() else []


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 300.0, poll: float = 0.001) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the kill"
        assert time.monotonic() < deadline, "timed out waiting for the moment to kill"
        time.sleep(poll)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_killed_mid_step_and_mid_save_resumes_like_an_unbroken_run(tmp_path: Path) -> None:
    # The suite's compilation cache, as the async test below: the runs compile the same programs
    # (one model, one bucket), so whichever runs second compiles almost nothing. A kill that
    # lands mid-write leaves a truncated entry, which JAX reads as a miss (a warning) and rewrites.
    env = _env(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))
    ref_dir, run_dir = tmp_path / "unbroken", tmp_path / "killed"
    ckpt_dir = run_dir / "checkpoints"

    proc = subprocess.run(_cmd(ref_dir, "checkpoint.every_seconds=0"), env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not (ref_dir / "checkpoints").exists()  # every_* 0: no checkpoints
    reference = _lines(ref_dir)
    assert [m["step"] for m in reference] == list(range(1, STEPS + 1))

    # 1. Killed mid-step: checkpoints every 2 steps; the kill comes once step 3 is logged (and the
    #    step-2 checkpoint is complete), while step 4 runs.
    p = _start(_cmd(run_dir, "checkpoint.every_steps=2"), env, tmp_path / "run1.log")
    _kill_when(p, lambda: len(_lines(run_dir)) >= 3 and 2 in _complete(ckpt_dir))
    done = _complete(ckpt_dir)[-1]
    assert len(_lines(run_dir)) > done  # steps past the checkpoint were logged: they must not show twice

    # 2. Resumed with a checkpoint every step, killed mid-save: as soon as a half-written step
    #    directory shows up. A kill that lands after orbax's final rename missed: resume again.
    for attempt in range(4):
        log = tmp_path / f"run2-{attempt}.log"
        before = _complete(ckpt_dir)[-1]
        p = _start(_cmd(run_dir, "checkpoint.every_steps=1", "--resume"), env, log)
        _kill_when(p, lambda b=before: any(int(n.split(".")[0]) > b for n in _half_written(ckpt_dir)))
        assert f"resuming from checkpoint step {before} " in log.read_text()
        if _half_written(ckpt_dir):
            break
    else:
        pytest.fail("four kills in a row missed the save")
    done = _complete(ckpt_dir)[-1]
    assert done < STEPS

    # 3. Resumed to the end: from the last complete checkpoint, the half-written one ignored and removed.
    proc = subprocess.run(_cmd(run_dir, "checkpoint.every_steps=1", "--resume"), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(rf"resuming from checkpoint step {done} ", proc.stdout), proc.stdout[-2000:]
    assert not _half_written(ckpt_dir) and _complete(ckpt_dir)[-1] == STEPS
    assert len(_complete(ckpt_dir)) == 3  # checkpoint.keep

    lines = _lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["failed"] == 0 for m in lines + reference)
    assert [sorted(m["prompt_ids"]) for m in lines] == [sorted(m["prompt_ids"]) for m in reference]
    assert [m["version"] for m in lines] == list(range(1, STEPS + 1))
    shown = _tensorboard_view(run_dir / "tensorboard")
    assert [s for s, _ in shown["reward_mean"]] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_async_run_killed_with_prompts_in_flight_trains_each_prompt_once(tmp_path: Path) -> None:
    """Asynchronous (rollout up to two versions ahead of the trainer), a checkpoint every step,
    SIGKILL a few steps in: the checkpoint it resumes from holds prompts in flight, which the
    resumed run trains (submitted again first); over both runs no prompt is trained twice but
    those the killed run trained after that checkpoint, and metrics.jsonl holds each step once."""
    from collections import Counter

    from etils import epath

    from areal_jax.trainer.checkpoint import CheckpointConfig, RunCheckpoints

    steps = 16
    env = _env(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]))  # the suite's: warm on a second run of it
    run_dir = tmp_path / "run"
    ckpt_dir = run_dir / "checkpoints"
    run = [a for a in RUN if not a.startswith(("rollout.mode=", "steps="))]
    cmd = [sys.executable, "-m", "areal_jax.cli", "train", "--config", str(ROOT / "configs" / "demo.yaml"), *run,
           f"run_dir={run_dir}", "rollout.mode=async", "rollout.max_staleness=2", "checkpoint.every_steps=1",
           f"steps={steps}"]

    p = _start(cmd, env, tmp_path / "run1.log")
    _kill_when(p, lambda: len(_lines(run_dir)) >= 4 and _complete(ckpt_dir)[-1:] >= [3], poll=0.02)
    killed = _lines(run_dir)
    ckpt = _complete(ckpt_dir)[-1]
    assert [m["step"] for m in killed] == list(range(1, len(killed) + 1)) and ckpt <= len(killed) < steps
    pending = RunCheckpoints(CheckpointConfig(), epath.Path(ckpt_dir)).read_meta(ckpt)["controller"]["pending"]
    assert pending, "no prompt was in flight at the checkpoint: the run did not run ahead"

    proc = subprocess.run([*cmd, "--resume"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"resuming from checkpoint step {ckpt} " in proc.stdout
    assert f"{len(pending)} prompts in flight submitted again" in proc.stdout

    lines = _lines(run_dir)
    assert [m["step"] for m in lines] == list(range(1, steps + 1))
    assert [m["version"] for m in lines] == list(range(1, steps + 1))
    assert lines[:ckpt] == killed[:ckpt]  # the lines up to the checkpoint kept as they were
    assert max(m["staleness_max"] for m in lines) >= 1 and all(m["failed"] == 0 for m in lines)
    trained = Counter(p for m in lines for p in m["prompt_ids"])
    assert max(trained.values()) == 1  # as one unbroken run: every prompt once
    resumed = {p for m in lines[ckpt:] for p in m["prompt_ids"]}
    assert set(pending) <= resumed  # the prompts in flight at the checkpoint were not lost
    # over both runs, only what the killed run trained after its last checkpoint comes twice
    both = Counter(p for m in killed + lines[ckpt:] for p in m["prompt_ids"])
    lost = {p for m in killed[ckpt:] for p in m["prompt_ids"]}
    assert {p for p, n in both.items() if n > 1} == lost and max(both.values()) <= 2
    print(f"\nkilled after step {len(killed)}, resumed from {ckpt} with {len(pending)} prompts in flight; "
          f"{len(lost)} prompts trained again")
