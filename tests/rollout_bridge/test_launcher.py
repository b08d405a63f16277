"""ServerFleet: embedded servers as child processes, health waits, death noticed, all stopped, also
when their parent is SIGTERMed or SIGKILLed."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
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


def test_fleet_reports_a_server_that_never_becomes_healthy(tmp_path: Path) -> None:
    """A server that runs but never answers /health within ``startup_timeout_s`` fails the start
    with an error quoting its log, and is stopped."""
    pid_file = tmp_path / "pid"
    hang = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                  "print('loading shards...', flush=True); time.sleep(120)"]
    fleet = ServerFleet(tmp_path, 1, tmp_path / "logs", startup_timeout_s=2, command=lambda i, port: hang)
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rollout server 0 .* did not answer /health within 2s; last lines of "
                                          r"\S*server-0.log") as e:
        fleet.start()
    assert time.monotonic() - t0 < 30
    assert "loading shards..." in str(e.value)  # the child's own output is quoted
    assert fleet.children == []
    with pytest.raises(ProcessLookupError):  # stopped, not left running
        os.kill(int(pid_file.read_text()), 0)


def test_a_fleet_stopped_while_it_starts_ends_its_start_at_once(tmp_path: Path) -> None:
    """``stop`` from another thread (a run that failed while its servers started, e.g. writing the
    tiny model they wait for) ends ``start`` at once. Before, ``start`` went on polling the
    stopped servers for ``startup_timeout_s`` (300 s by default), and the failed run with it."""
    import threading

    hang = [sys.executable, "-c", "import time; time.sleep(120)"]
    fleet = ServerFleet(tmp_path, 1, tmp_path / "logs", startup_timeout_s=300, command=lambda i, port: hang)
    box: dict[str, BaseException] = {}

    def start() -> None:
        try:
            fleet.start()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=start)
    t.start()
    while not fleet.children and t.is_alive():  # spawned: now waiting for /health
        time.sleep(0.01)
    fleet.stop()
    t.join(60)  # far below startup_timeout_s: the old start waited all of it
    assert not t.is_alive()
    assert isinstance(box.get("error"), LaunchError) and "stopped while they started" in str(box["error"])


def test_fleet_skips_the_server_warmup_unless_asked(tmp_path: Path) -> None:
    """A run's servers start at once (the run compiles only the shapes it uses); ``--server-warmup``
    in ``server_args`` keeps the start-up compile and is not passed on to ``serve``, which lacks it."""
    fleet = ServerFleet(tmp_path, 1, tmp_path, extra_args=["--context-length", "128"])
    assert fleet._warmup_args() == ["--skip-server-warmup"]
    fleet = ServerFleet(tmp_path, 1, tmp_path, extra_args=["--server-warmup", "--context-length", "128"])
    assert fleet._warmup_args() == [] and fleet.extra_args == ["--context-length", "128"]


# A stand-in for a server that knows nothing of its parent (as SGLang): answers /health, runs on.
_FAKE_SERVER = ("import http.server, sys\n"
                "class H(http.server.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n"
                "        self.send_response(200); self.end_headers()\n"
                "    def log_message(self, *a):\n"
                "        pass\n"
                "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")

# The parent of the fleet: starts it, prints its servers' pids, and waits to be signalled.
_FLEET_PARENT = f"""
import sys, time
from pathlib import Path
from areal_jax.cli import stop_on_sigterm
from rollout_bridge.launcher import ServerFleet
model, logs, fake = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "fake"
command = (lambda i, port: [sys.executable, "-c", {_FAKE_SERVER!r}, str(port)]) if fake else None
with stop_on_sigterm(), ServerFleet(model, 1, logs, command=command, startup_timeout_s=120,
                                    extra_args=["--skip-server-warmup", "--max-running-requests", "2"]) as fleet:
    print(" ".join(str(c.proc.pid) for c in fleet.children), flush=True)
    time.sleep(600)
"""


def _start_fleet_parent(model: Path, logs: Path, fake: bool) -> tuple[subprocess.Popen, int]:
    """A child Python process holding a one-server fleet, and that server's pid."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _FLEET_PARENT, str(model), str(logs), "fake" if fake else "real"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=root)
    line = proc.stdout.readline()  # once the server answers /health
    assert line.strip(), f"the fleet did not start (rc {proc.wait()}); server log:\n{_read(logs / 'server-0.log')}"
    return proc, int(line)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _kill_leftover(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_sigterm_to_the_parent_stops_its_servers(tmp_path: Path) -> None:
    """``areal-jax train``'s SIGTERM handling (``cli.stop_on_sigterm``) stops the fleet on the way
    out, even a server without a watchdog of its own (the stand-in, like SGLang): with the default
    action the parent vanished at once and the server, in its own session, ran on."""
    proc, server = _start_fleet_parent(tmp_path, tmp_path / "logs", fake=True)
    try:
        proc.send_signal(signal.SIGTERM)
        assert _gone_within(server, 5), "the server outlived its SIGTERMed parent"
        assert proc.wait(30) == 128 + signal.SIGTERM  # a clean exit, not death by the signal (-15)
    finally:
        proc.kill()
        _kill_leftover(server)


@pytest.mark.slow
def test_an_embedded_server_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the parent no chance to stop its servers: ``serve`` notices that its parent
    (``AREAL_JAX_PARENT_PID``, set by the fleet) is gone and shuts down by itself."""
    ckpt = make_tiny_checkpoint(tmp_path / "m", model_type="qwen2", size="tiny")
    proc, server = _start_fleet_parent(ckpt, tmp_path / "logs", fake=False)
    try:
        proc.kill()
        proc.wait(10)
        assert _gone_within(server, 10), "the server outlived its SIGKILLed parent"
        assert "is gone: shutting down" in _read(tmp_path / "logs" / "server-0.log")
    finally:
        _kill_leftover(server)
