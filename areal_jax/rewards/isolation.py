"""Which OS-level isolation the code sandbox gets on this machine, and the command that starts it.

The sandbox is bubblewrap (``bwrap``): a new user namespace in which the solution runs as uid
65534, a mount namespace that shows only the interpreter's installation and the system
libraries (read-only), ``/dev``'s null devices, an empty size-capped tmpfs work dir and ``/dev/shm``
(nothing else is writable), new network
(only a downed loopback: no TCP, no abstract or path unix sockets to the host), PID, IPC and UTS
namespaces, no capabilities, no nested user namespaces, and death with its parent. None of this
lives in the interpreter it guards, so nothing the solution does in Python or native code undoes it.

The resource limits (set by the harness before the solution runs) bind only for a uid that is not
root outside: run as root, the command therefore first drops to uid 65534, after binding the
interpreter where that uid can reach it in a private mount namespace (``unshare --mount``,
``setpriv``: util-linux). Where that is not allowed the sandbox runs root-mapped (its process-count
limit does not bind; the timeout and the PID namespace still end everything), and says so.

Where no isolation works, code rewards refuse to run (``SandboxUnavailable`` says how to get it)
unless ``reward.unsandboxed: true``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SANDBOX_UID = 65534
"""The uid the solution runs as inside the sandbox (and outside it, when the trainer runs as root)."""

TMPFS_BYTES = 64 << 20
"""Size of the sandbox's writable work dir (a tmpfs counts against memory)."""

SHM_BYTES = 4 << 20
"""Size of the sandbox's ``/dev/shm`` (``multiprocessing``'s locks live there)."""

HOW_TO_GET_IT = (
    "Install bubblewrap (Debian/Ubuntu: apt-get install -y bubblewrap; Fedora: dnf install bubblewrap) and "
    "allow user namespaces (Docker: --security-opt seccomp=unconfined --security-opt apparmor=unconfined, or "
    "--privileged; Kubernetes: securityContext.seccompProfile.type: Unconfined and, on AppArmor hosts, an "
    "unconfined AppArmor profile; Ubuntu 24.04 hosts: sysctl kernel.apparmor_restrict_unprivileged_userns=0). "
    "See BUILD.md, 'Code rewards'. To run model-written code with no isolation at all (only on a machine you "
    "can lose), set reward.unsandboxed: true.")


class SandboxUnavailable(RuntimeError):
    """No OS-level isolation works here and the config did not opt out of it."""


@dataclass(frozen=True)
class Isolation:
    """What a sandboxed run gets. ``kind`` is ``bwrap`` or ``none``; ``argv`` is the command
    that runs ``python -I -B -c HARNESS`` in it (the harness text appended by the caller)."""

    kind: str
    summary: str
    argv: tuple[str, ...] = ()
    own_pid_namespace: bool = False
    process_limit_binds: bool = False
    problem: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)


def interpreter() -> tuple[str, str]:
    """``(python executable, installation prefix)`` of the base interpreter (a venv's own
    ``site-packages`` stays outside the sandbox)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    return exe, prefix


def _library_mounts() -> list[str]:
    args: list[str] = []
    for d in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib", "/lib", "/lib64", "/lib32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    return args


def _bwrap_args(bwrap: str, python: str, prefix: str, source: str, as_root: bool) -> list[str]:
    """bwrap's command line up to and including the interpreter; ``source`` is where the
    interpreter's installation is visible to bwrap (``prefix``, or a bind of it)."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if as_root:
        args += ["--cap-drop", "ALL"]
    args += ["--ro-bind", source, prefix, *_library_mounts()]
    exe_dir = os.path.dirname(python)
    if not (exe_dir + os.sep).startswith(prefix + os.sep):
        args += ["--ro-bind", exe_dir, exe_dir]
    # every other writable place is read-only: bwrap's own root and /dev are tmpfs with no size
    # cap (a solution wrote 120 MiB to each of /, /usr, /dev and /dev/shm), memory the host loses
    args += ["--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm", "--size", str(TMPFS_BYTES),
             "--tmpfs", "/tmp", "--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp",
             "--", python, "-I", "-S", "-B", "-c"]
    return args


def _mount_point() -> str | None:
    """An existing directory over which the private mount namespace puts its own tmpfs."""
    return next((d for d in ("/mnt", "/media", "/srv", "/opt") if os.path.isdir(d)), None)


def _candidates() -> list[tuple[str, list[str], bool]]:
    """``(label, argv prefix, process limit binds)`` for each way to start bwrap, best first."""
    bwrap = shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap")
                                           if os.access(p, os.X_OK)), None)
    if bwrap is None:
        return []
    python, prefix = interpreter()
    if os.geteuid() != 0:
        return [(f"as uid {os.geteuid()}", _bwrap_args(bwrap, python, prefix, prefix, False), True)]
    out = []
    unshare, setpriv, mnt = shutil.which("unshare"), shutil.which("setpriv"), _mount_point()
    if unshare and setpriv and mnt:
        # root: bind the interpreter where uid 65534 can read it (a tmpfs over `mnt`, in a mount
        # namespace of this command only), then drop to that uid and start bwrap unprivileged.
        dropped = _bwrap_args(bwrap, python, prefix, f"{mnt}/py", False)
        script = (f'mount -t tmpfs -o size=1m,mode=755 areal-sandbox {mnt} && mkdir {mnt}/py && '
                  f'mount --bind "$0" {mnt}/py && mount -o remount,bind,ro {mnt}/py && '
                  f'exec {setpriv} --reuid {SANDBOX_UID} --regid {SANDBOX_UID} --clear-groups "$@"')
        out.append((f"dropped from root to uid {SANDBOX_UID}",
                    [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script, prefix, *dropped], True))
    out.append(("root-mapped", _bwrap_args(bwrap, python, prefix, prefix, True), False))
    return out


_PROBE = "import os, socket\nprint(os.getuid(), len(os.listdir('/')))\n"


@functools.cache
def detect() -> Isolation:
    """The best isolation that works here, found by running a probe in each candidate (cached
    per process: a few tens of milliseconds once)."""
    if not sys.platform.startswith("linux"):
        return Isolation("none", "no isolation (the code sandbox needs Linux)",
                         problem=f"code rewards need Linux user namespaces; this is {sys.platform}")
    candidates = _candidates()
    if not candidates:
        return Isolation("none", "no isolation (bubblewrap is not installed)",
                         problem="bubblewrap (`bwrap`) is not installed")
    errors = []
    # bubblewrap before 0.8 (Ubuntu 22.04 has 0.6) lacks --disable-userns and --size: try without them
    # (and without a /dev/shm that would have no cap; the work dir then has none either: BUILD.md)
    older = [(label + ", older bubblewrap (no size cap on the work dir)",
              _without(argv, {"--disable-userns": 0, "--size": 1, "/dev/shm": -1}), binds)
             for label, argv, binds in candidates]
    for label, argv, nproc_binds in candidates + older:
        try:
            r = subprocess.run([*argv, _PROBE], capture_output=True, timeout=30, stdin=subprocess.DEVNULL,
                               env=sandbox_env())
        except (OSError, subprocess.TimeoutExpired) as e:
            errors.append(f"{label}: {e}")
            continue
        if r.returncode == 0 and r.stdout.split()[:1] == [str(SANDBOX_UID).encode()]:
            python, prefix = interpreter()
            notes = () if nproc_binds else (
                "the process-count limit does not bind (bwrap runs root-mapped: uid 65534 could not be "
                "reached); a fork bomb is bounded by the timeout and the PID namespace only",)
            summary = (f"bubblewrap ({label}): uid {SANDBOX_UID} in a user namespace, no network, own PID/IPC/UTS "
                       f"namespaces, no capabilities; sees only {prefix} and the system libraries (read-only) "
                       f"and a {TMPFS_BYTES >> 20} MiB tmpfs work dir")
            return Isolation("bwrap", summary, tuple(argv), True, nproc_binds, notes=notes)
        errors.append(f"{label}: exit {r.returncode}: {r.stderr.decode(errors='replace').strip()[-300:]}")
    return Isolation("none", "no isolation (bubblewrap cannot start here)",
                     problem="bubblewrap cannot create its namespaces here (" + "; ".join(errors) + ")")


def _without(argv: list[str], options: dict[str, int]) -> list[str]:
    """``argv`` less each of ``options`` and its following ``n`` arguments (up to ``--``); ``n =
    -1``: the argument and the option before it."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--":
            return out + argv[i:]
        if argv[i] in options and options[argv[i]] < 0:
            out.pop()
            i += 1
            continue
        if argv[i] in options:
            i += 1 + options[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


def sandbox_env(workdir: str = "/tmp") -> dict[str, str]:
    """The whole environment of a sandboxed run: none of the trainer's variables (API keys...)."""
    return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def require(unsandboxed: bool) -> Isolation:
    """The isolation in force; raises ``SandboxUnavailable`` when there is none and the config
    did not set ``reward.unsandboxed: true``."""
    iso = detect()
    if iso.kind == "none" and not unsandboxed:
        raise SandboxUnavailable(f"code rewards refuse to run model-written code without isolation: "
                                 f"{iso.problem}. {HOW_TO_GET_IT}")
    return iso


def describe(unsandboxed: bool) -> str:
    """One line for the run's log: the isolation in force."""
    iso = detect()
    if iso.kind == "none":
        return (f"code sandbox: NONE ({iso.problem}); reward.unsandboxed is true, so model-written code runs "
                f"with this process's user's rights, no network or file isolation")
    return "code sandbox: " + iso.summary + "".join(f"; WARNING: {n}" for n in iso.notes)


def harness_source() -> str:
    return (Path(__file__).parent / "_harness.py").read_text()
