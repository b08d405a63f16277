"""A sandbox for model-written code: one process per run, in a fresh temporary directory that is
deleted afterwards.

Protections, and where they hold:

* Limits (``resource.setrlimit``, Linux and macOS): CPU seconds, address space, file size, open
  files, and process count (not enforced for root by the kernel; the audit layer covers it).
* Timeout: the run is a new session and its whole process group is killed at the deadline, so
  nothing it started survives (all POSIX systems). On Linux, where the user may create one, the
  run also gets its own PID namespace (``unshare --pid --fork --kill-child``): when it ends, the
  kernel kills every process in it, including one that left the process group (``setsid``).
* No network: a new network namespace (``unshare --net``, Linux, where the user may create one:
  root, or an unprivileged user namespace) with only a downed loopback, and, everywhere, socket
  creation refused at the Python layer.
* Environment: only ``PATH``, ``HOME`` and ``TMPDIR`` (both the run's directory), ``LANG`` and
  ``PYTHONIOENCODING``; the parent's variables (API keys...) are not passed. ``python -I``
  ignores ``PYTHON*`` variables and the user's site-packages.
* Files: an audit hook (``sys.addaudithook``, Python >= 3.8, every OS) installed before the
  program runs refuses opening any file outside the run's directory except reading the Python
  installation itself (the standard library the program imports), refuses writes, renames and
  deletes outside it, and refuses ``fork``/``exec``/``subprocess``/``os.system``, ``ctypes`` and
  changing directory or the resource limits. An audit hook cannot be removed from Python code;
  native code could bypass it, which is why modules that reach files or processes without an
  audit event cannot be imported: ``ctypes``, ``_posixsubprocess`` (its ``fork_exec`` starts a
  program), ``sqlite3``/``dbm`` (they open database files in C), ``readline``, ``_posixshmem``.

Not enforced: the file rules are Python-level only. There is no mount namespace, chroot or
seccomp filter, so a program that ran native code (a bug in an importable C extension) would see
the filesystem with the parent's user's rights. The process-count limit does not hold for root
(outside a user namespace); there, a fork that got past the hook is bounded only by the timeout
(and, with the PID namespace, cleaned up at its end).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

_GUARD = r'''
import os, resource, sys
for _what, _value in zip((resource.RLIMIT_CPU, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE,
                          resource.RLIMIT_NPROC, resource.RLIMIT_CORE), map(int, sys.argv[3].split(","))):
    try:
        resource.setrlimit(_what, (_value, _value))
    except (ValueError, OSError):
        pass
_ROOT = os.path.realpath(sys.argv[1])
_READ_OK = tuple(os.path.realpath(p) for p in sys.argv[2].split(os.pathsep) if p)
_main = os.path.join(_ROOT, "main.py")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path, roots):
    p = os.path.realpath(os.path.join(_ROOT, os.fsdecode(path)))
    return any(p == r or p.startswith(r + os.sep) for r in roots)

_BANNED = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
           "os.chdir", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "sys.setprofile", "sys.settrace",
           "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
           "resource.setrlimit", "resource.prlimit"}
_PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
                "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_LIST_EVENTS = {"os.listdir", "os.scandir"}
# native modules that call C libraries or the kernel with paths or processes the hook never sees
_NATIVE = {"ctypes", "_ctypes", "_posixsubprocess", "_sqlite3", "_dbm", "_gdbm", "readline", "_posixshmem"}

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int):
            return
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
        if _inside(path, (_ROOT,)) or (not writing and _inside(path, _READ_OK)):
            return
        raise PermissionError(f"sandbox: access to {path!r} outside the run directory is refused")
    if event in _BANNED:
        raise PermissionError(f"sandbox: {event} is refused")
    if event in _PATH_EVENTS:
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a, (_ROOT,)):
                raise PermissionError(f"sandbox: {event} on {a!r} outside the run directory is refused")
    if event in _LIST_EVENTS and args and isinstance(args[0], (str, bytes, os.PathLike)):
        if not _inside(args[0], (_ROOT,) + _READ_OK):
            raise PermissionError(f"sandbox: listing {args[0]!r} outside the run directory is refused")
    if event == "import" and args[0] in _NATIVE:
        raise PermissionError(f"sandbox: {args[0]} is refused")

sys.addaudithook(_hook)
del sys.argv[:4]
sys.argv.insert(0, _main)
__file__ = _main
with open(_main) as f:
    _code = compile(f.read(), _main, "exec")
exec(_code, {"__name__": "__main__", "__file__": _main, "__builtins__": __builtins__})
'''


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    """``unshare`` arguments that give a child its own empty network namespace and, where
    allowed, its own PID namespace (all its processes die with it); () where neither is allowed."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    pid = ("--pid", "--fork", "--kill-child")
    for args in ((exe, "--net", *pid, "--"), (exe, "--user", "--map-root-user", "--net", *pid, "--"),
                 (exe, "--net", "--"), (exe, "--user", "--map-root-user", "--net", "--")):
        try:
            if subprocess.run([*args, "true"], capture_output=True, timeout=10).returncode == 0:
                return args
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


def isolation() -> dict[str, bool]:
    """Which kernel isolation the runs get on this machine: ``net`` (own network namespace) and
    ``pid`` (own PID namespace)."""
    prefix = _netns_prefix()
    return {"net": "--net" in prefix, "pid": "--pid" in prefix}


def _read_roots() -> str:
    paths = {sys.base_prefix, sys.prefix, sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
             sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    return os.pathsep.join(sorted(p for p in paths if p))


def run_program(source: str, stdin: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512,
                max_file_mb: int = 16, max_open_files: int = 64, max_procs: int = 16) -> dict[str, Any]:
    """Run ``source`` as a Python program in the sandbox; returns ``returncode``, ``stdout``,
    ``stderr`` and ``timed_out``. The directory and every process of the run are gone on return."""
    root = Path(tempfile.mkdtemp(prefix="areal-sandbox-"))
    try:
        (root / "main.py").write_text(source)
        (root / "guard.py").write_text(_GUARD)
        # The limits are set by the guard itself before the program runs: no Python code runs
        # between fork and exec here, which would be unsafe in a multithreaded (JAX) parent.
        limits = ",".join(str(v) for v in (int(timeout_s) + 1, memory_mb << 20, max_file_mb << 20, max_open_files,
                                           max_procs, 0))
        cmd = [*_netns_prefix(), sys.executable, "-I", "-B", str(root / "guard.py"), str(root), _read_roots(), limits]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(root), "TMPDIR": str(root), "PYTHONIOENCODING": "utf-8",
               "LANG": "C.UTF-8"}
        proc = subprocess.Popen(cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            out, err = proc.communicate()
        finally:
            _kill_group(proc.pid)  # whatever it left behind in its session
        return {"returncode": proc.returncode, "stdout": out.decode(errors="replace")[-65536:],
                "stderr": err.decode(errors="replace")[-8192:], "timed_out": timed_out}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_tests(code: str, tests: Any, *, timeout_s: float = 5.0, memory_mb: int = 512) -> tuple[int, int, dict]:
    """``(passed, total, detail)``: ``tests`` is a list of ``{"input", "output"}`` pairs (stdin
    to stdout, compared line by line with trailing spaces stripped) or a string of ``assert``
    statements run after the code (one test: the program exits cleanly)."""
    if isinstance(tests, str):
        r = run_program(code + "\n\n" + tests + "\n", timeout_s=timeout_s, memory_mb=memory_mb)
        ok = r["returncode"] == 0 and not r["timed_out"]
        return int(ok), 1, {} if ok else {"error": _why(r)}
    passed, first_error = 0, None
    for t in tests:
        r = run_program(code, str(t["input"]), timeout_s=timeout_s, memory_mb=memory_mb)
        if r["returncode"] == 0 and not r["timed_out"] and _same_output(r["stdout"], str(t["output"])):
            passed += 1
        elif first_error is None:
            first_error = _why(r)
    return passed, len(tests), {} if first_error is None else {"error": first_error}


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def _why(r: dict[str, Any]) -> str:
    if r["timed_out"]:
        return "timed out"
    if r["returncode"] != 0:
        return (r["stderr"].strip().splitlines() or [f"exit code {r['returncode']}"])[-1][:300]
    return "wrong output"
