"""MetricsLogger: JSONL lines, TensorBoard events that TensorBoard's reader parses, wandb offline
records that wandb's reader parses, the progress bar, and the end-of-run plot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_jax.trainer.metrics import LogConfig, MetricsLogger, plot_metrics, read_metrics


def _steps(n: int) -> list[dict]:
    return [{"step": s, "version": s, "time": 3.0 * s, "reward_mean": 0.1 * s, "staleness_max": s % 3,
             "note": "text stays in JSONL", **({"eval_accuracy": 0.2 * s} if s % 2 == 0 else {})}
            for s in range(1, n + 1)]


def test_jsonl_and_tensorboard(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path, LogConfig(progress=False), total_steps=4)
    for m in _steps(4):
        logger.log(m)
    logger.close()
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert lines[1]["eval_accuracy"] == pytest.approx(0.4) and lines[0]["note"] == "text stays in JSONL"

    from tensorboardX.crc32c import crc32c  # an independent CRC-32C
    from tensorboardX.event_file_writer import event_pb2  # the protobuf TensorBoard reads

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    scalars, versions = {}, []
    data = events[0].read_bytes()
    pos = 0
    while pos < len(data):  # TFRecord framing: length(8) crc(4) payload crc(4)
        n = int.from_bytes(data[pos:pos + 8], "little")
        assert int.from_bytes(data[pos + 8:pos + 12], "little") == masked(data[pos:pos + 8])
        payload = data[pos + 12:pos + 12 + n]
        assert int.from_bytes(data[pos + 12 + n:pos + 16 + n], "little") == masked(payload)
        ev = event_pb2.Event.FromString(payload)
        assert ev.wall_time > 1.7e9
        versions += [ev.file_version] if ev.HasField("file_version") else []
        pos += 16 + n
        for v in ev.summary.value:
            scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    assert versions == ["brain.Event:2"]  # the first event, as TensorBoard expects
    assert scalars["reward_mean"] == [(s, pytest.approx(0.1 * s)) for s in range(1, 5)]
    assert scalars["eval_accuracy"] == [(2, pytest.approx(0.4)), (4, pytest.approx(0.8))]
    assert "note" not in scalars


def test_wandb_offline_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The offline run's record (what ``wandb sync`` uploads), read back with wandb's own reader
    (``wandb leet inspect --json``): each step's numbers at its step, the run config, no text."""
    import wandb  # noqa: F401  (the test extra installs it)
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, LogConfig(progress=False, tensorboard=False, wandb_project="areal-test"),
                           run_config={"steps": 2})
    for m in _steps(3):
        logger.log(m)
    run_dir = Path(logger._wandb.dir).parent
    logger.close()
    [record] = run_dir.glob("*.wandb")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(record)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # `wandb leet inspect` is in the test extra's wandb>=0.31
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2, 3]
    for m in _steps(3):
        logged = history[m["step"]]
        for key in ("version", "time", "reward_mean", "staleness_max", "eval_accuracy"):
            assert logged.get(key) == (pytest.approx(m[key]) if key in m else None), (m["step"], key)
        assert "note" not in logged  # text stays in the JSONL
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["config"]["update"]["steps"] == 2


def test_progress_bar_shows_reward_staleness_and_version(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(tmp_path, LogConfig(progress=True, tensorboard=False), total_steps=4)
    for m in _steps(4):
        logger.log(m)
    logger.write("a line between steps")
    logger.close()
    captured = capsys.readouterr()
    err = captured.err  # tqdm draws on stderr
    final = err.replace("\r", "\n").strip().splitlines()[-1]  # the bar as it stays on screen
    assert final.startswith("RL: 100%") and "4/4" in final
    # the last step's: reward_mean 0.4, staleness_max 1, version 4, eval_accuracy 0.8
    assert "reward=0.400, stale=1, v=4, eval_acc=0.800" in final
    assert "a line between steps" in captured.out  # tqdm.write: on stdout, the bar moved aside


def test_plot(tmp_path: Path) -> None:
    out = plot_metrics(_steps(6), tmp_path / "curves.png", eval_before={"eval_accuracy": 0.1})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_jsonl_is_valid_json_per_line(tmp_path: Path) -> None:
    import numpy as np

    logger = MetricsLogger(tmp_path, LogConfig(progress=False, tensorboard=False))
    logger.log({"step": 1, "loss": np.float32(0.5), "n": np.int64(3)})
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "loss": 0.5, "n": 3}


def test_a_new_run_replaces_an_old_runs_metrics(tmp_path: Path) -> None:
    for n in (3, 2):
        logger = MetricsLogger(tmp_path, LogConfig(progress=False))
        for m in _steps(n):
            logger.log(m)
        logger.close()
    assert [m["step"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1


def _tensorboard_view(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars as TensorBoard shows them: events files in order, and a ``SessionLog.START`` at step
    ``s`` hides the events of steps >= ``s`` read before it (TensorBoard's purge on restart)."""
    from tensorboardX.event_file_writer import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(tb_dir.glob("events.out.tfevents.*")):
        data, pos = f.read_bytes(), 0
        while pos < len(data):
            n = int.from_bytes(data[pos:pos + 8], "little")
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            if ev.HasField("session_log") and ev.session_log.status == event_pb2.SessionLog.START:
                scalars = {k: [(s, v) for s, v in vs if s < ev.step] for k, vs in scalars.items()}
            for v in ev.summary.value:
                scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return scalars


def test_a_resumed_run_continues_without_duplicate_steps(tmp_path: Path) -> None:
    """Killed after step 5 (its last line cut short) and resumed from a step-3 checkpoint: the
    JSONL keeps steps 1-3 and goes on from 4, and TensorBoard shows each step once."""
    logger = MetricsLogger(tmp_path, LogConfig(progress=False))
    for m in _steps(5):
        logger.log(m)
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "rew')  # a kill mid-write
    logger = MetricsLogger(tmp_path, LogConfig(progress=False), start_step=3)
    assert [m["step"] for m in logger.history] == [1, 2, 3]
    for m in _steps(7)[3:]:
        logger.log({**m, "resumed": 1})
    logger.close()
    lines = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert [m.get("resumed") for m in lines] == [None] * 3 + [1] * 4
    shown = _tensorboard_view(tmp_path / "tensorboard")
    assert [s for s, _ in shown["reward_mean"]] == [1, 2, 3, 4, 5, 6, 7]
    assert [s for s, _ in shown["resumed"]] == [4, 5, 6, 7]


def test_crc32c_and_int64_steps_as_tensorboard_reads_them(tmp_path: Path) -> None:
    """The checksum is CRC-32C (its published check value), and a step past 2**31 survives."""
    from tensorboardX.event_file_writer import event_pb2

    from areal_jax.trainer.tensorboard import EventWriter, crc32c

    assert crc32c(b"123456789") == 0xE3069283
    writer = EventWriter(tmp_path)
    writer.add_scalars({"loss": -1.5, "a/b": 3.0}, step=2**40)
    writer.close()
    data = writer.path.read_bytes()
    first = int.from_bytes(data[:8], "little")
    pos = 16 + first
    n = int.from_bytes(data[pos:pos + 8], "little")
    ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
    assert ev.step == 2**40 and [(v.tag, v.simple_value) for v in ev.summary.value] == [("loss", -1.5), ("a/b", 3.0)]
    # TensorBoard reads a folder's files in name order: the order they were made, a resumed run's last
    made = [EventWriter(tmp_path / "many", filename_suffix=".resumed-3" if i % 2 else "") for i in range(12)]
    for w in made:
        w.close()
    assert sorted(w.path.name for w in made) == [w.path.name for w in made]


def test_a_tensorboard_folder_that_cannot_be_made_fails_at_the_start(tmp_path: Path) -> None:
    (tmp_path / "tensorboard").write_text("a file where the events folder goes")
    with pytest.raises(OSError, match="tensorboard"):
        MetricsLogger(tmp_path, LogConfig(progress=False))
