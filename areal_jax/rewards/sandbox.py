"""Running model-written code against a row's tests, treating the code as hostile.

* **Isolation**: each run is a bubblewrap sandbox (``isolation.py``): its own user, no network,
  no host files but the interpreter, a tmpfs work dir, its own PID namespace. The harness inside
  (``_harness.py``) sets the resource limits (address space, CPU, file size, open files,
  processes) before the solution runs.
* **A pass the solution cannot forge**: the expected answers never enter the sandbox. Stdin/stdout
  tests are compared here with the output the harness captured. In assert tests, the calls into
  the solution run inside and report their values, and the rest of each assertion (the literals:
  the answers) is evaluated here (``asserts.py``: ``assert add(1, 2) == 3``, ``assert abs(f(x) -
  0.5) < 1e-6``, ``sorted``, ``len``, ``math.isclose``...). A test counts as passed only when the
  harness, after the test's last statement, sends the run's random nonce, and every assertion
  judged here held and ran. ``SystemExit``, ``os._exit``, a signal, an ``atexit`` hook, a closed
  or hijacked fd, a replaced ``print``, an object equal to everything all leave the test
  unpassed. A test with an *inside check* (``asserts.py``: an assertion that cannot be split, a
  ``raise``, no split assertion at all) would be judged in the solution's process, which the
  solution owns (it can read the nonce from the harness's memory, or return an object equal to
  everything): such a test fails closed, unrun, and its code (which may hold the answers of the
  row's other tests) never enters the sandbox, unless ``trust_inside_checks`` says otherwise.
* **Bounded**: output is read incrementally and capped (``max_output`` bytes, then the program is
  stopped: it cannot match any more), each test has its own timeout and the row a budget of
  ``timeout_s`` per test (at most ``row_timeout_s``); on any timeout the sandbox's process group
  is killed, and with it its PID namespace: nothing survives, and nothing is written to the host's
  disk (the payload travels in a memfd). bwrap dies with the process that started it, so a reward
  pool that kills its worker kills the sandbox too.
* **Fast**: all of a row's tests run in one sandbox; assert tests in one process, stdin/stdout
  tests as forks of the clean harness. A sandbox that dies mid-row fails the test it was running
  and a new one runs the rest.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

from areal_jax.rewards import asserts, isolation
from areal_jax.rewards.isolation import SandboxUnavailable

log = logging.getLogger(__name__)

MAX_OUTPUT = 1 << 20
"""Bytes of a test's stdout kept (and compared); past it the program is stopped."""
STARTUP_S = 10.0
"""Allowance for starting the sandbox and the interpreter, on top of the tests' own time."""
_MAX_LINE = 4 << 20
"""A harness message longer than this is a protocol violation (base64 output fits well inside)."""


def run_tests(code: str, tests: Any, *, timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 16,
              row_timeout_s: float = 60.0, max_output: int = MAX_OUTPUT, unsandboxed: bool = False,
              stop_at_first_failure: bool = False,
              trust_inside_checks: bool = False) -> tuple[int, int, dict[str, Any]]:
    """``(passed, total, detail)`` of ``code`` on ``tests``: a list of ``{"input", "output"}``
    pairs (stdin to stdout, compared line by line with trailing spaces stripped), a string of
    ``assert`` code (one test), or a list of such strings (one test each). ``timeout_s`` bounds
    each test, ``timeout_s * len(tests)`` (at most ``row_timeout_s``) the whole row.
    ``stop_at_first_failure``: the rest fail unrun (an all-or-nothing reward needs no more).
    ``trust_inside_checks``: run assert tests with inside checks (see the module docstring) in the
    solution's process, where a hostile solution can forge their pass, instead of failing them."""
    iso = isolation.require(unsandboxed)
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, list):
        raise ValueError(f"tests must be assert code, a list of it, or a list of {{input, output}}; got {tests!r:.80}")
    n = len(tests)
    if n == 0:
        return 0, 0, {}
    stdio = all(isinstance(t, dict) for t in tests)
    if not stdio and not all(isinstance(t, str) for t in tests):
        raise ValueError("tests must be all assert strings or all {input, output} pairs, not a mix")
    row_deadline = time.monotonic() + STARTUP_S + min(timeout_s * n, row_timeout_s)
    verdicts: dict[int, bool] = {}
    first_error: list[str] = []

    def fail(i: int, why: str) -> None:
        verdicts.setdefault(i, False)
        if not first_error:
            first_error.append(f"test {i}: {why}" if n > 1 else why)

    if stdio:
        payload_tests, expected = [str(t["input"]) for t in tests], [str(t["output"]) for t in tests]
    else:
        split = [asserts.split_asserts(t) for t in tests]
        payload_tests, expected = [s for s, _, _ in split], [table for _, table, _ in split]
        if not trust_inside_checks:
            for i, (_, _, inside) in enumerate(split):
                if inside:
                    fail(i, f"refused: {inside[0]}: {INSIDE_CHECK}")
                    payload_tests[i] = ""  # its code never enters the sandbox: it may hold other tests' answers
                    _warn_once(inside[0])
    while len(verdicts) < n:
        if stop_at_first_failure and not all(verdicts.values()):
            for i in range(n):
                fail(i, "not run: an earlier test failed")
            break
        todo = [i for i in range(n) if i not in verdicts]
        if time.monotonic() >= row_deadline:
            for i in todo:
                fail(i, f"row budget of {min(timeout_s * n, row_timeout_s):g}s used up")
            break
        nonce = secrets.token_hex(16)
        judge = _Judge(todo, stdio, expected, nonce, verdicts, fail, stop_at_first_failure)
        payload = {"mode": "stdio" if stdio else "asserts", "code": code, "tests": [payload_tests[i] for i in todo],
                   "nonce": nonce, "timeout_s": timeout_s, "max_output": max_output,
                   "limits": _limits(memory_mb, max_processes)}
        ended = _run_sandbox(iso, payload, judge.on_message, per_test_s=timeout_s + (2.0 if stdio else 0.0),
                             row_deadline=row_deadline)
        if judge.load_error is not None or judge.loading:  # the solution itself failed or hung: every test would
            for i in todo:
                fail(i, judge.load_error or f"the solution's own code: {ended.get('why') or 'it ended'}")
            break
        undecided = [i for i in todo if i not in verdicts]
        if not undecided:
            break
        if stop_at_first_failure and not all(verdicts.values()):
            continue  # the top of the loop fails the rest
        culprit = judge.current if judge.current in undecided else undecided[0]
        if judge.current is None and not ended.get("timed_out"):  # it never got to a test: it would not now
            for i in undecided:
                fail(i, ended.get("why") or "the sandbox ended before the tests ran")
            break
        fail(culprit, ended.get("why") or "the sandbox ended during this test")
    passed = sum(verdicts.get(i, False) for i in range(n))
    return passed, n, {"error": first_error[0]} if first_error and passed < n else {}


INSIDE_CHECK = ("this test would be judged inside the solution's process, where a solution can forge its pass, so it "
                "fails closed; write its assertions as calls into the solution compared with literals (`assert "
                "f(1) == 2`), or set reward.code_trust_inside_checks: true (forgeable; see BUILD.md, 'Code rewards')")
_warned: set[str] = set()


def _warn_once(what: str) -> None:
    """Log the first refused test of each kind (a dataset repeats its style in every row)."""
    kind = what.split(": ", 1)[-1][:40]
    if kind not in _warned and len(_warned) < 20:
        _warned.add(kind)
        log.warning("code reward: a test refused (%s): %s", what, INSIDE_CHECK)


class _Judge:
    """Turns the harness's messages for one sandbox run into verdicts, comparing with answers
    that stayed out here."""

    def __init__(self, todo: list[int], stdio: bool, expected: list[Any], nonce: str, verdicts: dict[int, bool],
                 fail: Callable[[int, str], None], stop_at_first_failure: bool):
        self.todo, self.stdio, self.expected, self.nonce = todo, stdio, expected, nonce
        self.verdicts, self.fail, self.stop_early = verdicts, fail, stop_at_first_failure
        self.current: int | None = None
        self.loading = False
        """Between ``start -1`` and the first test: the solution's own module code runs."""
        self.load_error: str | None = None
        self.seen: dict[int, set[int]] = {}
        self.wrong: dict[int, str] = {}

    def _index(self, j: Any) -> int | None:
        return self.todo[j] if isinstance(j, int) and 0 <= j < len(self.todo) else None

    def on_message(self, msg: dict[str, Any]) -> bool:
        """Judge ``msg``; ``True`` when the run need not go on."""
        self._judge(msg)
        return self.stop_early and not all(self.verdicts.get(i, True) for i in self.todo)

    def _judge(self, msg: dict[str, Any]) -> None:
        if "start" in msg:
            self.current = self._index(msg["start"])
            self.loading = msg["start"] == -1 and not self.stdio
        elif "done" in msg and self.stdio:
            i = self._index(msg["done"])
            if i is None or i in self.verdicts:
                return
            out = base64.b64decode(str(msg.get("out", "")), validate=False).decode("utf-8", "replace")
            if msg.get("timed_out"):
                self.fail(i, "timed out")
            elif msg.get("truncated"):
                self.fail(i, f"more than {MAX_OUTPUT >> 20} MiB of output")
            elif msg.get("rc") != 0:
                err = str(msg.get("err", "")).strip().splitlines()
                self.fail(i, (err or [f"exit code {msg.get('rc')}"])[-1][:300])
            elif not _same_output(out, self.expected[i]):
                self.fail(i, "wrong output")
            else:
                self.verdicts[i] = True
        elif "val" in msg and not self.stdio:
            j, k, enc = (msg["val"] + [None, None, None])[:3] if isinstance(msg["val"], list) else (None, None, None)
            i = self._index(j)
            if i is None or not isinstance(k, int) or k not in self.expected[i]:
                return
            self.seen.setdefault(i, set()).add(k)
            if i in self.wrong or i in self.verdicts:
                return  # decided: a flood of reports costs no more judging
            try:
                ok, why = asserts.judge(self.expected[i][k], enc), "it does not hold for the values reported"
            except Exception as e:  # noqa: BLE001 - values from the solution: any failure to judge them is a fail
                ok, why = False, f"{type(e).__name__}: {e}"[:300]
            if not ok:
                self.wrong.setdefault(i, f"assertion {k} failed: {why}")
        elif "pass" in msg and not self.stdio:
            i = self._index(msg["pass"])
            if i is None or i in self.verdicts:
                return
            if not secrets.compare_digest(str(msg.get("nonce", "")).encode(), self.nonce.encode()):
                self.fail(i, "the pass did not carry the run's nonce")
            elif i in self.wrong:
                self.fail(i, self.wrong[i])
            elif missing := set(self.expected[i]) - self.seen.get(i, set()):
                self.fail(i, f"assertion {min(missing)} never ran")
            else:
                self.verdicts[i] = True
        elif "fail" in msg and not self.stdio:
            i = self._index(msg["fail"])
            if i is not None:
                self.fail(i, self.wrong.get(i) or str(msg.get("error", "failed"))[:300])
        elif "load_error" in msg:
            self.load_error = str(msg["load_error"])[:300]


def _run_sandbox(iso: isolation.Isolation, payload: dict[str, Any], on_message: Callable[[dict[str, Any]], Any],
                 *, per_test_s: float, row_deadline: float) -> dict[str, Any]:
    """Run the harness on ``payload`` in the sandbox, feeding each of its messages to
    ``on_message`` as it arrives (a true answer stops the run); returns ``{"timed_out", "why",
    "stdout", "stderr"}``. The sandbox's whole process tree is gone on return."""
    workdir = None
    if iso.kind == "bwrap":
        argv = [*iso.argv, isolation.harness_source()]
        env = isolation.sandbox_env()
        payload["workdir"], payload["own_pid_namespace"] = "/tmp", True
    else:  # reward.unsandboxed: the same harness and bounds, no isolation
        python, _ = isolation.interpreter()
        workdir = tempfile.mkdtemp(prefix="areal-sandbox-")
        argv = [python, "-I", "-S", "-B", "-c", isolation.harness_source()]
        env = isolation.sandbox_env(workdir)
        payload["workdir"], payload["own_pid_namespace"] = workdir, False
    res_r, res_w = os.pipe()
    payload["result_fd"] = res_w
    data = json.dumps(payload).encode()
    memfd = os.memfd_create("areal-sandbox-payload")
    try:
        os.write(memfd, data)  # a memfd takes it all at once; the sandbox reads it as its stdin
        os.lseek(memfd, 0, os.SEEK_SET)
        proc = subprocess.Popen(argv, stdin=memfd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(res_w,),
                                env=env, cwd=workdir or "/", start_new_session=True)
    except BaseException:
        os.close(res_r)
        raise
    finally:
        os.close(res_w)
        os.close(memfd)
        del data
    result = {"timed_out": False, "why": "", "stdout": b"", "stderr": b""}
    try:
        _pump(proc, res_r, on_message, per_test_s, row_deadline, result)
    finally:
        _kill_group(proc.pid)
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(res_r)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if not result["why"] and proc.returncode not in (0, None):
        err = result["stderr"].decode("utf-8", "replace").strip().splitlines()
        result["why"] = (err or [f"the sandbox exited with {proc.returncode}"])[-1][:300]
    return result


def _pump(proc: subprocess.Popen, res_r: int, on_message: Callable[[dict[str, Any]], Any], per_test_s: float,
          row_deadline: float, result: dict[str, Any]) -> None:
    """Read the harness's messages and the sandbox's own stdout/stderr (a bounded head and tail)
    until it ends, a message is malformed, or a deadline passes."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(res_r, selectors.EVENT_READ, "result")
    line = bytearray()
    out, err = bytearray(), bytearray()
    test_deadline = time.monotonic() + STARTUP_S + per_test_s
    try:
        while sel.get_map():
            now = time.monotonic()
            deadline = min(test_deadline, row_deadline)
            if now >= deadline:
                result["timed_out"] = True
                result["why"] = "timed out" if test_deadline <= row_deadline else "row budget used up"
                return
            for key, _ in sel.select(deadline - now):
                fd = key.fd if key.data == "result" else key.fileobj.fileno()
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data == "stdout":
                    out += chunk[:max(0, MAX_OUTPUT - len(out))]
                elif key.data == "stderr":
                    err = (err + chunk)[-8192:]
                else:
                    line += chunk
                    while (nl := line.find(b"\n")) >= 0:
                        raw, line = bytes(line[:nl]), line[nl + 1:]
                        try:
                            msg = json.loads(raw)
                        except (ValueError, RecursionError):
                            msg = None
                        if not isinstance(msg, dict):
                            result["why"] = "the sandbox's harness sent a malformed message"
                            return
                        if "start" in msg:
                            test_deadline = time.monotonic() + per_test_s
                        try:
                            stop = on_message(msg)
                        except Exception as e:  # noqa: BLE001 - fields the solution wrote (bad base64, a non-ASCII nonce)
                            result["why"] = f"the sandbox sent a message that cannot be judged ({type(e).__name__})"
                            return
                        if stop:
                            return
                    if len(line) > _MAX_LINE:
                        result["why"] = "the sandbox's harness sent an oversized message"
                        return
    finally:
        sel.close()
        result["stdout"], result["stderr"] = bytes(out), bytes(err)


def _limits(memory_mb: int, max_processes: int) -> dict[str, int]:
    """The resource limits the harness sets before the solution runs: per process address space,
    file size (16 MiB) and open files (64); processes and threads of the sandbox's uid (its init
    and the harness count). Memory at worst: ``max_processes * memory_mb`` plus the tmpfs."""
    return {"as": memory_mb << 20, "fsize": 16 << 20, "nofile": 64, "nproc": max_processes}


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(source: str, stdin: str = "", *, timeout_s: float = 5.0, memory_mb: int = 512,
                max_processes: int = 16, unsandboxed: bool = False) -> dict[str, Any]:
    """Run ``source`` as a Python program in the sandbox (one stdin/stdout test, nothing to
    compare); returns ``returncode``, ``stdout``, ``stderr`` and ``timed_out``."""
    iso = isolation.require(unsandboxed)
    got: dict[str, Any] = {}

    def keep(msg: dict[str, Any]) -> None:
        if "done" in msg:
            got.update(msg)

    payload = {"mode": "stdio", "code": source, "tests": [stdin], "nonce": "", "timeout_s": timeout_s,
               "max_output": MAX_OUTPUT, "limits": _limits(memory_mb, max_processes)}
    ended = _run_sandbox(iso, payload, keep, per_test_s=timeout_s + 2.0,
                         row_deadline=time.monotonic() + STARTUP_S + timeout_s + 2.0)
    if not got:
        return {"returncode": None, "stdout": "", "stderr": ended["stderr"].decode("utf-8", "replace"),
                "timed_out": bool(ended["timed_out"])}
    return {"returncode": got.get("rc"), "timed_out": bool(got.get("timed_out")),
            "stdout": base64.b64decode(str(got.get("out", ""))).decode("utf-8", "replace"),
            "stderr": str(got.get("err", ""))}


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


__all__ = ["MAX_OUTPUT", "SandboxUnavailable", "run_program", "run_tests"]
