"""ServerFleet: embedded servers as child processes, health waits, death noticed, all stopped."""

import json
import os
import shutil
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from areal_jax.models.tiny import make_tiny_checkpoint
from rollout_bridge.launcher import LaunchError, ServerFleet


@pytest.mark.slow
def test_fleet_starts_notices_a_dead_child_and_stops_all(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "models" / "m")  # a model.path outside the run directory
    shutil.copytree(ckpt, tmp_path / "run" / "weights" / "v1")  # where a run's DiskSink writes
    shutil.copytree(ckpt, tmp_path / "elsewhere")
    fleet = ServerFleet(ckpt, 2, tmp_path / "run" / "logs",
                        extra_args=["--max-running-requests", "4", "--skip-server-warmup"], startup_timeout_s=120)
    addresses = fleet.start()
    try:
        assert len(addresses) == 2 and len(set(addresses)) == 2
        for a in addresses:
            with urllib.request.urlopen(f"http://{a}/health", timeout=5) as r:
                assert r.status == 200
        fleet.check()  # all alive
        # the servers load a run's weight pushes (under the run directory), and nothing outside
        assert _load_from_disk(addresses[0], tmp_path / "run" / "weights" / "v1") == (200, True)
        assert _load_from_disk(addresses[0], tmp_path / "elsewhere") == (400, False)
        pids = [c.proc.pid for c in fleet.children]
        os.kill(pids[1], signal.SIGKILL)
        fleet.children[1].proc.wait(10)
        with pytest.raises(LaunchError, match="rollout server 1 .* exited with code -9"):
            fleet.check()
    finally:
        fleet.stop()
    for pid in pids:  # nothing left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _load_from_disk(address: str, path: Path) -> tuple[int, bool]:
    req = urllib.request.Request(f"http://{address}/update_weights_from_disk", method="POST",
                                 data=json.dumps({"model_path": str(path)}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())["success"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["success"]


def test_fleet_reports_a_server_that_cannot_start(tmp_path: Path) -> None:
    fleet = ServerFleet(tmp_path / "no-such-model", 1, tmp_path / "logs", startup_timeout_s=60)
    with pytest.raises(LaunchError, match=r"rollout server 0 .* exited with code \d+; last lines") as e:
        fleet.start()
    assert "no-such-model" in str(e.value)  # the child's own error is quoted
    assert fleet.children == []


def test_fleet_skips_the_server_warmup_unless_asked(tmp_path: Path) -> None:
    """A run's servers start at once (the run compiles only the shapes it uses); ``--server-warmup``
    in ``server_args`` keeps the start-up compile and is not passed on to ``serve``, which lacks it."""
    fleet = ServerFleet(tmp_path, 1, tmp_path, extra_args=["--context-length", "128"])
    assert fleet._warmup_args() == ["--skip-server-warmup"]
    fleet = ServerFleet(tmp_path, 1, tmp_path, extra_args=["--server-warmup", "--context-length", "128"])
    assert fleet._warmup_args() == [] and fleet.extra_args == ["--context-length", "128"]
