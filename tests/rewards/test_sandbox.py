"""The code sandbox refuses what model-written code must not do, and leaves nothing behind."""

import json
import os
import time
from pathlib import Path

import pytest

from areal_jax.rewards import sandbox
from areal_jax.rewards.sandbox import run_program


def _refused(result: dict, what: str) -> None:
    assert result["returncode"] != 0, result
    assert what in result["stderr"], result["stderr"][-500:]


def test_runs_ordinary_code_with_stdin_and_its_own_files() -> None:
    r = run_program("import json, collections\nn = int(input())\nopen('scratch.txt', 'w').write(str(n * 2))\n"
                    "print(json.dumps({'double': int(open('scratch.txt').read())}))", "21")
    assert r == {"returncode": 0, "stdout": '{"double": 42}\n', "stderr": "", "timed_out": False}


def test_reading_outside_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "checkpoint" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("weights")
    _refused(run_program(f"print(open({str(secret)!r}).read())"), "outside the run directory is refused")
    _refused(run_program(f"import os; print(os.listdir({str(tmp_path)!r}))"), "outside the run directory")
    _refused(run_program(f"print(open({str(Path.home() / '.bashrc')!r}).read())"), "refused")  # the user's home
    _refused(run_program("print(open('/etc/hostname').read())"), "refused")


def test_writing_outside_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "evil.txt"
    _refused(run_program(f"open({str(target)!r}, 'w').write('x')"), "outside the run directory is refused")
    _refused(run_program(f"import os; os.remove({str(Path(__file__))!r})"), "refused")
    assert not target.exists() and Path(__file__).exists()


def test_network_is_refused() -> None:
    _refused(run_program("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 80))"), "socket")
    _refused(run_program("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1/')"), "refused")


def test_fork_bomb_and_subprocess_are_refused() -> None:
    _refused(run_program("import os\nwhile True:\n    os.fork()"), "os.fork is refused")
    _refused(run_program("import subprocess\nsubprocess.run(['sleep', '100'])"), "refused")
    _refused(run_program("import ctypes"), "ctypes is refused")


def test_endless_loop_is_killed_at_the_timeout() -> None:
    t0 = time.monotonic()
    r = run_program("while True:\n    pass", timeout_s=1.0)
    assert r["timed_out"] and time.monotonic() - t0 < 5


def test_memory_past_the_limit_fails() -> None:
    _refused(run_program("x = bytearray(1 << 31)", memory_mb=256), "MemoryError")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_nothing_survives_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even a program that got a child started (here: the hook turned off, as if a native
    extension had bypassed it) leaves no process behind: the whole group is killed."""
    monkeypatch.setattr(sandbox, "_GUARD", sandbox._GUARD.replace("sys.addaudithook(_hook)", ""))
    pids = []
    real_popen = sandbox.subprocess.Popen

    def recording_popen(*a, **kw):
        p = real_popen(*a, **kw)
        pids.append(p.pid)
        return p

    monkeypatch.setattr(sandbox.subprocess, "Popen", recording_popen)
    code = "import subprocess, time\nsubprocess.Popen(['sleep', '60'])\nprint('started', flush=True)\ntime.sleep(60)"
    r = run_program(code, timeout_s=1.5)
    assert r["timed_out"] and "started" in r["stdout"]
    time.sleep(0.2)
    assert _live_in_group(pids[-1]) == []  # the sandbox's process group: none left running


def _live_in_group(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (a killed orphan waits to be reaped by init)."""
    live = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(int(entry))
    return live


def test_directory_is_removed() -> None:
    r = run_program("import os; print(os.getcwd())")
    assert r["returncode"] == 0 and not Path(r["stdout"].strip()).exists()


# --- issue 15: what the kernel enforces, and native routes around the audit hook ---------------------

def test_native_routes_around_the_hook_are_refused(tmp_path: Path) -> None:
    """``_posixsubprocess.fork_exec`` starts a program (here: ``cat`` of a file outside) without an
    audit event, and sqlite opens its database file in C: both are refused at import."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    spawn = ("import _posixsubprocess, os, time\nr, w = os.pipe()\n"
             f"_posixsubprocess.fork_exec([b'/bin/cat', {str(secret).encode()!r}], [b'/bin/cat'], True, (), None, "
             "None, -1, -1, -1, -1, -1, -1, r, w, False, True, -1, None, None, -1, -1, None, False)\ntime.sleep(0.5)")
    r = run_program(spawn)
    _refused(r, "_posixsubprocess is refused")
    assert "hunter2" not in r["stdout"]
    db = tmp_path / "planted.db"
    _refused(run_program(f"import sqlite3\nsqlite3.connect({str(db)!r}).execute('create table t(x)')"),
             "_sqlite3 is refused")
    assert not db.exists()
    _refused(run_program("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))"), "refused")


def test_environment_and_home_are_the_runs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_TEST_SECRET_KEY", "s3cr3t")
    r = run_program("import os, json\nprint(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}))")
    assert r["returncode"] == 0, r
    out = json.loads(r["stdout"])
    assert "s3cr3t" not in r["stdout"] and set(out["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONIOENCODING"}
    assert out["env"]["HOME"] == out["cwd"] and Path(out["cwd"]).name.startswith("areal-sandbox-")


@pytest.mark.skipif(not sandbox.isolation()["net"], reason="no network namespace can be created on this machine")
def test_network_namespace_holds_even_past_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the hook gone (as if native code bypassed it), a socket cannot reach a server that
    listens on this machine's loopback: the run has its own network namespace."""
    import socket

    monkeypatch.setattr(sandbox, "_GUARD", sandbox._GUARD.replace("sys.addaudithook(_hook)", ""))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        r = run_program(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                        "    print('connected')\nexcept OSError as e:\n    print('refused', e)")
    assert r["returncode"] == 0 and r["stdout"].startswith("refused"), r


@pytest.mark.skipif(not sandbox.isolation()["pid"], reason="no PID namespace can be created on this machine")
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc (Linux)")
def test_a_process_that_left_the_group_dies_with_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child in a new session escapes a process-group kill (and holds the output pipes open, so
    the run would not return before it ends); the PID namespace ends it with the run."""
    monkeypatch.setattr(sandbox, "_GUARD", sandbox._GUARD.replace("sys.addaudithook(_hook)", ""))
    marker = f"{60 + os.getpid() % 1000 / 1000:.3f}"  # sleep's argument names our process
    code = (f"import subprocess, time\nsubprocess.Popen(['sleep', '{marker}'], start_new_session=True)\n"
            "print('started', flush=True)\ntime.sleep(60)")
    t0 = time.monotonic()
    r = run_program(code, timeout_s=1.5)
    elapsed = time.monotonic() - t0
    assert r["timed_out"] and "started" in r["stdout"]
    survivors = []
    for _ in range(20):
        time.sleep(0.1)
        survivors = _sleepers(marker)
        if not survivors:
            break
    for pid in survivors:  # leave nothing behind even when the test fails
        os.kill(pid, 9)
    assert survivors == [] and elapsed < 10, (survivors, elapsed)


def _sleepers(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if cmd == b"sleep\0" + marker.encode() + b"\0" and stat.rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry))
    return found
