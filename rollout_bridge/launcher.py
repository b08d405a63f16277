"""Starting rollout servers as child processes, and stopping every one of them.

``ServerFleet`` starts ``areal-jax serve`` processes (or, given a ``command``, any server that
speaks the protocol: real SGLang) on free loopback ports, each confined to its ``Placement``
(devices through its environment, CPU cores through its affinity), waits for each
``/health`` with a timeout (on failure the error carries the child's last log lines), watches
them while the run lasts (``check()`` starts a child that died again on its own port, up to
``max_restarts`` times in all, then raises naming it), and stops all it started on exit, on
Ctrl-C, and when the parent itself fails. A restarted server comes back with the weights it was
launched with; the rollout client keeps it out of rotation until it holds the current version.
Logs go to one file per server. The servers load weights from disk only under ``weight_roots``
(default: the directory holding the model and the run directory, the parent of ``log_dir``,
where a run's weight pushes go).

Each child learns its parent's pid (``AREAL_JAX_PARENT_PID``): an embedded server shuts down
on its own within about a second of its parent's death, SIGKILL included, when nothing was left
to stop it (the servers run in their own session, so a signal to the parent's process group
does not reach them). A real SGLang server (``command``) has no such watchdog: one whose trainer
was SIGKILLed runs on until the scheduler ends the job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollout_bridge.placement import Placement

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "AREAL_JAX_PARENT_PID"
"""The environment variable that gives each child the pid of the process that started it."""


class LaunchError(RuntimeError):
    """A server that did not come up, or died; the message names it and quotes its log."""


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    address: str
    log: Path
    cmd: list[str]


def process_age() -> float | None:
    """Seconds since this process started (interpreter start-up and imports included), from
    ``/proc``; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            started = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pinned(cmd: list[str], cores: frozenset[int] | None) -> list[str]:
    """``cmd`` started on ``cores`` only: a small Python trampoline sets its affinity, then
    becomes ``cmd`` (every thread the server starts inherits it). No ``preexec_fn``: forking a
    multithreaded parent and running Python in the child can deadlock."""
    if cores is None:
        return cmd
    pin = "import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); " \
          "os.execvp(sys.argv[2], sys.argv[2:])"
    return [sys.executable, "-c", pin, ",".join(str(c) for c in sorted(cores)), *cmd]


def _shown(cmd: list[str]) -> str:
    """The command line as a log shows it, with the value of ``--api-key`` hidden."""
    shown = ["***" if i and cmd[i - 1] == "--api-key" else a for i, a in enumerate(cmd)]
    return shlex.join(shown)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in text[-lines:]) or "    (empty log)"


class ServerFleet:
    """``num_servers`` servers for one model directory: embedded ones, or those ``command(i, port)``
    starts (its argv for server ``i`` on ``port``; ``extra_args`` and ``weight_roots`` are then
    the command's business). ``placements[i]`` confines server ``i``."""

    def __init__(self, model_path: str | Path, num_servers: int, log_dir: str | Path, *,
                 extra_args: list[str] | None = None, seed: int = 0, startup_timeout_s: float = 300.0,
                 env: dict[str, str] | None = None, weight_roots: list[str | Path] | None = None,
                 command: Callable[[int, int], list[str]] | None = None,
                 placements: list[Placement] | None = None, max_restarts: int = 0):
        if num_servers < 1:
            raise ValueError(f"rollout.num_servers must be >= 1, got {num_servers}")
        if placements is not None and len(placements) != num_servers:
            raise ValueError(f"{len(placements)} placements for {num_servers} servers")
        self.model_path = str(model_path)
        self.num_servers = num_servers
        self.log_dir = Path(log_dir)
        extra_args = list(extra_args or [])
        # ``--server-warmup`` is the fleet's own flag (``serve`` warms up unless told to skip).
        self.server_warmup = "--server-warmup" in extra_args
        self.extra_args = [a for a in extra_args if a != "--server-warmup"]
        self.seed = seed
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        if weight_roots is None:
            weight_roots = [Path(self.model_path).absolute().parent, self.log_dir.absolute().parent]
        self.weight_roots = [str(r) for r in weight_roots]
        self.command = command
        self.placements = placements
        self.children: list[_Child] = []
        self.max_restarts = max_restarts
        self.restarts = 0
        """Children started again after they died, over the fleet's life."""

    @property
    def addresses(self) -> list[str]:
        return [c.address for c in self.children]

    def start(self) -> list[str]:
        """Start every server and wait until all answer ``/health``; returns their addresses."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            for i in range(self.num_servers):
                port = _free_port()
                log = self.log_dir / f"server-{i}.log"
                cmd = self.command(i, port) if self.command is not None else [
                    sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", self.model_path,
                    "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(self.seed + i),
                    "--weight-roots", *self.weight_roots, *self._warmup_args(), *self.extra_args]
                with log.open("w") as f:
                    f.write("$ " + _shown(cmd) + "\n")
                proc = self._spawn(cmd, log, "a", i)
                self.children.append(_Child(f"rollout server {i} (pid {proc.pid}, port {port})", proc,
                                            f"127.0.0.1:{port}", log, cmd))
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.addresses

    def _spawn(self, cmd: list[str], log: Path, mode: str, index: int) -> subprocess.Popen:
        """Start server ``index``'s ``cmd`` in its placement, its output appended to ``log``."""
        place = self.placements[index] if self.placements is not None else Placement(())
        # Its own session lets ``stop`` end the server's own children with it (``killpg``) and
        # keeps a terminal's Ctrl-C off them while the parent stops them; so nothing reaches
        # them when the parent dies, and the parent's pid lets ``serve`` notice that itself.
        env = {**os.environ, **(self.env or {}), **place.env, PARENT_PID_ENV: str(os.getpid())}
        with log.open(mode) as f:
            return subprocess.Popen(_pinned(cmd, place.cpu_affinity), stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=env)

    def _warmup_args(self) -> list[str]:
        """A run's fleet skips the start-up compile of every step shape unless ``server_args`` ask
        for it (``--server-warmup``): the run compiles only the shapes its requests use, while the
        trainer waits for its first batch anyway."""
        return [] if self.server_warmup else ["--skip-server-warmup"]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = list(self.children)
        while pending:
            if not self.children:  # ``stop`` from another thread (the run failed while they started)
                raise LaunchError("the rollout servers were stopped while they started")
            self.check(restart=False)  # a server that cannot start would only fail again
            pending = [c for c in pending if not _healthy(c.address)]
            if pending and time.monotonic() > deadline:
                c = pending[0]
                raise LaunchError(f"{c.name} did not answer /health within {self.startup_timeout_s:.0f}s; "
                                  f"last lines of {c.log}:\n{_tail(c.log)}")
            if pending:
                time.sleep(0.25)

    def check(self, restart: bool = True) -> None:
        """Start a child that has exited again on its port (without waiting for it: the client
        takes it back once it answers), or once ``max_restarts`` are used up (or with
        ``restart=False``, as while the fleet starts), raise ``LaunchError`` naming it."""
        for i, c in enumerate(self.children):
            code = c.proc.poll()
            if code is None:
                continue
            if not restart or self.restarts >= self.max_restarts:
                used = f" (after {self.restarts} restarts)" if self.restarts else ""
                raise LaunchError(f"{c.name} exited with code {code}{used}; last lines of {c.log}:\n{_tail(c.log)}")
            self.restarts += 1
            logger.warning("%s exited with code %d; starting it again (restart %d of %d); last lines of %s:\n%s",
                           c.name, code, self.restarts, self.max_restarts, c.log, _tail(c.log, 5))
            with c.log.open("a") as f:
                f.write(f"\n--- exited with code {code}; restarted by the fleet ---\n")
            proc = self._spawn(c.cmd, c.log, "a", i)
            port = c.address.rsplit(":", 1)[1]
            c.proc, c.name = proc, f"rollout server {i} (pid {proc.pid}, port {port})"

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate every child (their whole process groups), killing those that linger."""
        for c in self.children:
            if c.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in self.children:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()
        self.children.clear()
        atexit.unregister(self.stop)

    def __enter__(self) -> ServerFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
