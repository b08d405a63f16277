"""The program that runs inside the code sandbox (``python -I -S -B -c <this file's text>``): it reads
one row's work from stdin, runs it, and reports on fd 3. Standard library only; nothing here
imports areal_jax, since the sandbox shows the interpreter and nothing else.

Its stdin is a JSON payload: ``mode`` (``stdio`` or ``asserts``), the solution's ``code``,
``tests`` (stdin strings, or assert code in which the assertions judged outside became
``__areal_check__(k, (values...))``: see ``asserts.py``), ``nonce``, ``limits``, ``timeout_s``,
``max_output``, ``workdir``, ``own_pid_namespace`` and ``result_fd``. It answers one JSON line per
event on the result fd: ``{"start": i}`` when test ``i`` starts (``-1``: the solution's own code;
the outside restarts its per-test clock), then

* stdio: ``{"done": i, "rc", "out" (base64, at most ``max_output`` bytes), "truncated",
  "err" (stderr's tail), "timed_out"}``; each test is a fresh fork of this clean program, in
  its own process group, and every process it left is killed before the next test.
* asserts: ``{"val": [i, k, encoded values]}`` each time a split assertion runs, and ``{"pass":
  i, "nonce": ...}`` only after the last statement of test ``i`` returned (``{"fail": i,
  "error"}`` on an exception; ``{"load_error"}`` when the solution's own code raised). A
  ``SystemExit``, ``os._exit``, a signal or a closed result fd means no ``pass``.

The outside compares outputs, and judges the values, with answers that never enter the sandbox.
"""

import base64
import builtins
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback


class _Quitter:
    """``exit()`` and ``quit()``, which ``site`` would define (the sandbox's Python runs without
    ``site``: no site-packages, and 90 ms less to start)."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Use {self.name}() or Ctrl-D (i.e. EOF) to exit"

    def __call__(self, code=None):
        raise SystemExit(code)


builtins.exit, builtins.quit = _Quitter("exit"), _Quitter("quit")
_write = os.write
_dumps = json.dumps
_out = [3]  # the result fd (the payload names it)


def _send(msg):
    data = (_dumps(msg, separators=(",", ":")) + "\n").encode()
    while data:
        data = data[_write(_out[0], data):]


def _limit(limits, cpu_s):
    for what, value in ((resource.RLIMIT_AS, limits["as"]), (resource.RLIMIT_FSIZE, limits["fsize"]),
                        (resource.RLIMIT_NOFILE, limits["nofile"]), (resource.RLIMIT_NPROC, limits["nproc"]),
                        (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, max(1, int(cpu_s) + 1))):
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass


def _run_main(code):
    """Run ``code`` as ``python main.py`` would, then leave with its exit status."""
    rc = 0
    try:
        exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        rc = rc or 120
    os._exit(rc & 0xFF)


def _stdio_test(i, code, stdin_text, payload):
    limits, timeout_s, cap = payload["limits"], payload["timeout_s"], payload["max_output"]
    stdin_path = os.path.join(payload["workdir"], ".stdin")
    with open(stdin_path, "w") as f:
        f.write(stdin_text)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            fd = os.open(stdin_path, os.O_RDONLY)
            os.dup2(fd, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            os.unlink(stdin_path)
            _limit(limits, timeout_s)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
        except BaseException:
            os._exit(121)
        _run_main(code)
    os.close(out_w)
    os.close(err_w)
    out, err, total = bytearray(), bytearray(), 0
    deadline = time.monotonic() + timeout_s
    open_fds, timed_out, truncated = {out_r, err_r}, False, False
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select(list(open_fds), [], [], left)
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
                os.close(fd)
            elif fd == out_r:
                total += len(chunk)
                out += chunk[:max(0, cap - len(out))]
                if total > cap:  # past the cap the answer cannot match: stop it rather than drain a flood
                    truncated = True
                    open_fds.clear()
            else:
                err = (err + chunk)[-4096:]
    for fd in open_fds | {out_r, err_r}:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if payload["own_pid_namespace"]:
        try:
            os.kill(-1, signal.SIGKILL)  # everything else in this PID namespace but us: what the test left
        except OSError:
            pass
    status = os.waitpid(pid, 0)[1]
    while True:  # reap the rest (they are our children or were re-parented to the namespace's init)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    _clear(payload["workdir"])  # the next test starts in an empty work dir, with all its room
    rc = os.waitstatus_to_exitcode(status)
    _send({"done": i, "rc": rc, "timed_out": timed_out, "truncated": truncated,
           "out": base64.b64encode(bytes(out)).decode(), "err": err.decode("utf-8", "replace")})


def _clear(workdir):
    for entry in os.listdir(workdir):
        path = os.path.join(workdir, entry)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            pass


def _encode(v, depth=0):
    """A value the outside can rebuild with no code of ours: builtin types only, by exact kind."""
    if depth > 100:
        raise ValueError("nested more than 100 deep")
    if v is None or isinstance(v, (bool, str)):
        return v if type(v) in (type(None), bool, str) else str.__str__(v)
    if isinstance(v, int):
        v = int(v)  # past 4300 decimal digits JSON cannot write it: hex has no such limit
        return v if v.bit_length() < 10000 else {"i": format(v, "x")}
    if isinstance(v, float):
        return {"f": float.__repr__(float(v))}
    if isinstance(v, complex):
        return {"c": [float.__repr__(v.real), float.__repr__(v.imag)]}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, list):
        return [_encode(x, depth + 1) for x in list.__iter__(v)]
    if isinstance(v, tuple):
        return {"t": [_encode(x, depth + 1) for x in tuple.__iter__(v)]}
    if isinstance(v, (set, frozenset)):
        return {"s": [_encode(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"d": [[_encode(k, depth + 1), _encode(x, depth + 1)] for k, x in dict.items(v)]}
    raise TypeError(f"a {type(v).__name__} is not a builtin value")


def _asserts(payload):
    nonce, tests = payload["nonce"], payload["tests"]
    current = [-1]

    def check(k, value):
        try:
            enc = _encode(value)
        except Exception as e:  # noqa: BLE001 - any failure to encode is a mismatch, reported as such
            enc = {"x": f"{type(e).__name__}: {e}"[:200]}
        _send({"val": [current[0], k, enc]})

    ns = {"__name__": "__main__", "__builtins__": __builtins__, "__areal_check__": check}
    _send({"start": -1})
    try:
        exec(compile(payload.pop("code"), "main.py", "exec"), ns)
    except BaseException as e:  # SystemExit included: a solution that leaves before the tests fails them all
        _send({"load_error": _last_line(e)})
        return
    for i, test in enumerate(tests):
        current[0] = i
        _send({"start": i})
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
        except BaseException as e:
            _send({"fail": i, "error": _last_line(e)})
            continue
        _send({"pass": i, "nonce": nonce})


def _last_line(e):
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) before the tests finished"
    lines = traceback.format_exception_only(type(e), e)
    return (lines[-1].strip() if lines else type(e).__name__)[:300]


def _main():
    payload = json.loads(sys.stdin.buffer.read())
    _out[0] = payload["result_fd"]
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    os.chdir(payload["workdir"])
    if payload["mode"] == "stdio":
        for i, stdin_text in enumerate(payload["tests"]):
            _send({"start": i})
            _stdio_test(i, payload["code"], stdin_text, payload)
    else:
        _limit(payload["limits"], payload["timeout_s"] * (len(payload["tests"]) + 1))
        _asserts(payload)
    _send({"end": True})


_main()
