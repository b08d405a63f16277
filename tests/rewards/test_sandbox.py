"""The code sandbox holds against a hostile solution. Each escape is judged by what it did outside
(a marker file that must not appear, listeners that must not get a connection, a process that
must stay alive, processes and files left behind), never by what the sandbox returned; and a wrong
solution cannot score by leaving early or by faking the harness's report."""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from areal_jax.rewards import asserts, isolation, sandbox
from areal_jax.rewards.sandbox import run_program, run_tests
from tests.procmem import resident_mib

ROOT = Path(__file__).resolve().parents[2]
needs_sandbox = pytest.mark.skipif(isolation.detect().kind != "bwrap",
                                   reason=f"no sandbox here ({isolation.detect().problem}); see BUILD.md")


@pytest.fixture
def outside():
    """A directory anyone may write to (so that an escaped sandbox could), with a secret in it,
    a unix socket, an abstract unix socket and a TCP socket listening, and a sentinel process of
    the sandbox's own outer uid."""
    d = Path(tempfile.mkdtemp(prefix="areal-outside-"))
    d.chmod(0o777)
    (d / "secret.txt").write_text("hunter2-" + "x" * 1234)
    (d / "secret.txt").chmod(0o644)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(d / "listener.sock"))
    (d / "listener.sock").chmod(0o777)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0areal-outside-{os.getpid()}")
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    for s in (unix, abstract, tcp):
        s.listen()
        s.setblocking(False)
    as_nobody = {"user": isolation.SANDBOX_UID, "group": isolation.SANDBOX_UID} if os.geteuid() == 0 else {}
    sentinel = subprocess.Popen(["sleep", "120"], **as_nobody)
    yield {"dir": d, "sockets": (unix, abstract, tcp), "port": tcp.getsockname()[1], "sentinel": sentinel,
           "abstract": f"areal-outside-{os.getpid()}"}
    sentinel.kill()
    sentinel.wait()
    for s in (unix, abstract, tcp):
        s.close()
    shutil.rmtree(d, ignore_errors=True)


def _escape_program(o: dict) -> str:
    """Every escape the issue lists, each tried and its outcome printed; run as one program."""
    d, marker = str(o["dir"]), str(o["dir"] / "marker")
    return f"""
import os, sys, json, socket
out = {{}}
def attempt(name, fn):
    try:
        out[name] = repr(fn())[:200]
    except BaseException as e:
        out[name] = 'refused: ' + type(e).__name__
import builtins
builtins.any = lambda *a: True  # the old audit hook's tables and helpers, switched off
import __main__
for v in list(vars(__main__).values()):
    if isinstance(v, (set, dict)): v.clear()
attempt('write', lambda: open({marker!r}, 'w').write('escaped'))
attempt('read', lambda: open({d + '/secret.txt'!r}).read())
attempt('stat', lambda: os.stat({d + '/secret.txt'!r}).st_size)
attempt('listdir', lambda: os.listdir({d!r}))
attempt('os.system', lambda: os.system('touch {marker}; id > {marker}'))
import subprocess
attempt('subprocess', lambda: subprocess.run(['/usr/bin/touch', {marker!r}]).returncode)
def native():
    import ctypes
    libc = ctypes.CDLL(None)
    return (libc.creat({marker.encode()!r}, 0o644), libc.system(b'touch {marker}'))
attempt('ctypes', native)
def unix(addr):
    s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(addr); s.send(b'escaped'); return 'connected'
attempt('unix socket', lambda: unix({d + '/listener.sock'!r}))
attempt('abstract socket', lambda: unix('\\0' + {o['abstract']!r}))
attempt('tcp', lambda: socket.create_connection(('127.0.0.1', {o['port']}), timeout=2) and 'connected')
attempt('kill sentinel', lambda: os.kill({o['sentinel'].pid}, 9))
attempt('uid', os.getuid)
attempt('root', lambda: sorted(os.listdir('/')))
print(json.dumps(out), flush=True)
"""


def _killer_program(o: dict) -> str:
    """Kill the sentinel outside, then every process this run can reach (its harness included)."""
    pid = o["sentinel"].pid
    return (f"import os, signal\nfor how in (lambda: os.kill({pid}, 9), lambda: os.killpg({pid}, 9), "
            "lambda: os.kill(os.getppid(), 9), lambda: os.kill(1, 9)):\n"
            "    try:\n        how()\n    except OSError:\n        pass\nos.kill(-1, 9)\n")


def _judge_outside(o: dict, r: dict) -> None:
    """Nothing happened outside the sandbox, whatever the sandbox said."""
    assert not (o["dir"] / "marker").exists()
    for s in o["sockets"]:
        with pytest.raises(BlockingIOError):
            s.accept()  # no connection was ever made
    assert o["sentinel"].poll() is None, "the sentinel process outside was killed"
    assert "hunter2" not in r["stdout"] and "1242" not in r["stdout"], r["stdout"]  # content, size


@needs_sandbox
def test_escapes_as_this_user_leave_nothing_outside(outside) -> None:
    run_program(_killer_program(outside))
    r = run_program(_escape_program(outside), timeout_s=20)
    _judge_outside(outside, r)
    seen = json.loads(r["stdout"].splitlines()[0])  # the program ran, and saw only the sandbox
    assert seen["uid"] == str(isolation.SANDBOX_UID) and "'tmp'" in seen["root"], seen



@pytest.mark.skipif(os.geteuid() != 0, reason="the root-mapped fallback is root's")
def test_escapes_in_the_root_mapped_fallback_leave_nothing_outside(outside, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where root may not drop to uid 65534 (a container without CAP_SYS_ADMIN), bwrap runs
    root-mapped: weaker (the process limit does not bind, and the log says so), still sealed."""
    mapped = [c for c in isolation._candidates() if c[0] == "root-mapped"]
    monkeypatch.setattr(isolation, "_candidates", lambda: mapped)
    isolation.detect.cache_clear()
    try:
        if isolation.detect().kind != "bwrap":
            pytest.skip("bubblewrap cannot start root-mapped here")
        assert "process-count limit does not bind" in isolation.describe(False)
        run_program(_killer_program(outside))
        r = run_program(_escape_program(outside), timeout_s=20)
        _judge_outside(outside, r)
        assert json.loads(r["stdout"].splitlines()[0])["uid"] == str(isolation.SANDBOX_UID)
    finally:
        isolation.detect.cache_clear()

_AS_NOBODY = """
import json, sys
sys.path.insert(0, {root!r})
from areal_jax.rewards import isolation, sandbox
iso = isolation.detect()
if iso.kind != "bwrap":  # nothing to escape from: the caller skips
    print(json.dumps({{"iso": iso.kind, "problem": iso.problem}}))
    sys.exit(0)
sandbox.run_program({killer!r})
print(json.dumps({{"iso": "bwrap", "r": sandbox.run_program({prog!r}, timeout_s=20)}}))
"""


def _unprivileged_python() -> str | None:
    """An interpreter the unprivileged uid can run (the test's own may sit in root's home)."""
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            ok = subprocess.run([exe, "-c", "import sys; assert sys.version_info >= (3, 10)"], capture_output=True,
                                user=isolation.SANDBOX_UID, group=isolation.SANDBOX_UID, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok:
            return exe
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="this process is already unprivileged (the test above covers it)")
def test_escapes_as_an_unprivileged_user_leave_nothing_outside(outside) -> None:
    exe = _unprivileged_python()
    if exe is None:
        pytest.skip("no Python >= 3.10 that uid 65534 can run")
    code = _AS_NOBODY.format(root=str(ROOT), prog=_escape_program(outside), killer=_killer_program(outside))
    p = subprocess.run([exe, "-I", "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                       user=isolation.SANDBOX_UID, group=isolation.SANDBOX_UID, extra_groups=[])
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    if got["iso"] != "bwrap":
        pytest.skip(f"no sandbox for an unprivileged user here ({got['problem']})")
    _judge_outside(outside, got["r"])
    assert json.loads(got["r"]["stdout"].splitlines()[0])["uid"] == str(isolation.SANDBOX_UID)


# --- a pass the solution cannot forge ----------------------------------------------------------------

WRONG = "def add(a, b):\n    return a - b\n"
TESTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 5) - 5 == 0\n"
CHEATS = {
    "sys.exit(0) at load": WRONG + "import sys\nsys.exit(0)\n",
    "raise SystemExit at load": WRONG + "raise SystemExit(0)\n",
    "exit() at load": WRONG + "exit()\n",
    "os._exit(0) at load": WRONG + "import os\nos._exit(0)\n",
    "os._exit(0) in the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "sys.exit in the call": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "SIGKILL itself in the call": "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "kill everything": "import os\ndef add(a, b):\n    os.kill(-1, 9)\n    os._exit(0)\n",
    "atexit": WRONG + "import atexit, os\natexit.register(lambda: print('PASS'))\nos._exit(0)\n",
    "close all fds": "import os\ndef add(a, b):\n    os.closerange(0, 1024)\n    return 0\n",
    "fake reports on every fd": (
        "import os, json\ndef add(a, b):\n    for fd in range(1, 64):\n        try:\n"
        "            os.write(fd, b'{\"pass\": 0, \"nonce\": \"\"}\\n' + b'{\"val\": [0, 0, 3]}\\n')\n"
        "        except OSError:\n            pass\n    os._exit(0)\n"),
    "a non-ASCII nonce (it made the scorer raise)": (
        "import gc, json, os\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'nonce' in o and 'result_fd' in o:\n"
        "            os.write(o['result_fd'], json.dumps({'pass': 0, 'nonce': 'é'}).encode() + b'\\n')\n"
        "            os._exit(0)\n"),
    "patched print and stdout": (
        "import sys, builtins\nbuiltins.print = lambda *a, **k: None\nsys.stdout = None\n" + WRONG),
    "always-equal object": (
        "class Eq(int):\n    def __eq__(self, o): return True\n    def __sub__(self, o): return Eq(0)\n"
        "def add(a, b):\n    return Eq(a - b)\n"),
    "replaced report function": WRONG + "__areal_check__ = lambda k, v: None\n",
}


INSIDE = "def check(f):\n    return f(1, 2) == 3 and f(2, 2) == 4\nassert check(add)\n"
"""A test judged inside the solution's process (it cannot be split): refused unless trusted."""


@needs_sandbox
def test_wrong_solutions_that_cheat_score_zero() -> None:
    right = WRONG.replace("a - b", "a + b")
    assert run_tests(right, TESTS) == (1, 1, {}) and run_tests(right, INSIDE, trust_inside_checks=True) == (1, 1, {})
    assert asserts.split_asserts(INSIDE)[1] == {} and len(asserts.split_asserts(TESTS)[1]) == 3
    for name, code in CHEATS.items():
        passed, total, detail = run_tests(code, TESTS, timeout_s=5)
        assert (passed, total) == (0, 1) and detail.get("error"), (name, detail)
        if name != "always-equal object":  # inside the process an object equal to everything wins: see BUILD.md
            assert run_tests(code, INSIDE, timeout_s=5, trust_inside_checks=True)[0] == 0, name


FORGERS = {
    # the harness's payload (its nonce and report fd) found with gc, and a pass sent for test 0
    "nonce read from memory": (
        "import gc, json, os\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'nonce' in o and 'result_fd' in o:\n"
        "            os.write(o['result_fd'], json.dumps({'pass': 0, 'nonce': o['nonce']}).encode() + b'\\n')\n"
        "            os._exit(0)\n", INSIDE),
    "object equal to everything, in an `or`": (
        "class E:\n    def __eq__(s, o):\n        return True\ndef add(a, b):\n    return E()\n",
        "assert add(1, 2) == 3 or add(2, 2) == 4"),
    # the test's own reference, replaced from the solution's frame before the test calls it
    "reference function replaced": (
        "import sys\ndef add(a, b):\n    sys._getframe(1).f_globals['ref'] = lambda a, b: 0\n    return 0\n",
        "def ref(a, b):\n    return a + b\nassert add(1, 2) == ref(1, 2)"),
    "reference bound with functools.partial": (
        "import gc\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'ref' in o and '__areal_check__' in o:\n"
        "            o['ref'] = lambda a, b: 0\n    return 0\n",
        "import functools\ndef _add(a, b):\n    return a + b\nref = functools.partial(_add)\n"
        "assert add(1, 2) == ref(1, 2)"),
    "reference as a method of the test's class": (
        "import gc\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, type) and o.__name__ == 'Ref':\n"
        "            o.add = lambda s, a, b: 0\n    return 0\n",
        "class Ref:\n    def add(self, a, b):\n        return a + b\nr = Ref()\nassert add(1, 2) == r.add(1, 2)"),
    "unittest's assertEqual beside a split assert": (
        "class E:\n    def __eq__(s, o):\n        return True\n"
        "def add(a, b):\n    return 3 if (a, b) == (1, 2) else E()\n",
        "import unittest\nassert add(1, 2) == 3\nunittest.TestCase().assertEqual(add(2, 2), 4)"),
    "assert False after an expected exception": (
        "import gc, json, os\ndef add(a, b):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'nonce' in o and 'result_fd' in o:\n"
        "            os.write(o['result_fd'], json.dumps({'pass': 0, 'nonce': o['nonce']}).encode() + b'\\n')\n"
        "            os._exit(0)\n", "try:\n    add('x', 1)\n    assert False\nexcept TypeError:\n    pass"),
}


@needs_sandbox
def test_a_solution_that_owns_its_process_cannot_pass_a_check_made_there() -> None:
    """Tests that would be judged inside the solution's process fail closed, unrun: each of these
    wrong solutions passes its test when such checks are trusted (which is why they are not)."""
    for name, (code, test) in FORGERS.items():
        assert run_tests(code, test, timeout_s=5, trust_inside_checks=True)[0] == 1, name
        passed, total, detail = run_tests(code, test, timeout_s=5)
        assert (passed, total) == (0, 1) and detail["error"].startswith("refused: line"), (name, detail)
    # a refused test's code never enters the sandbox: here it holds the answer of the split test 0
    leak = ("import gc, re\ndef secret():\n    for o in gc.get_objects():\n"
            "        if isinstance(o, dict) and 'tests' in o and 'nonce' in o:\n"
            "            found = re.findall('W[0-9]+', ' '.join(o['tests']))\n            if found:\n"
            "                return found[0]\n")
    tests = ["assert secret() == 'W4711'", "assert secret() == 'W4711' or False"]
    assert run_tests(leak, tests, trust_inside_checks=True)[0] == 2  # trusted, the answer leaks to test 0
    assert run_tests(leak, tests)[0] == 0
    passed, total, detail = run_tests("def secret():\n    return 'W4711'\n", tests)
    assert (passed, total) == (1, 2) and detail["error"].startswith("test 1: refused: line 1"), detail
    assert asserts.split_asserts("x = f(1)\nassert True")[2] == ["no assertion in it can be judged outside the sandbox"]


@needs_sandbox
def test_common_test_styles_are_judged_outside_and_pass_right_answers() -> None:
    """Truth of a call (a match object), a method of the solution's class, names bound to its
    results, HumanEval's ``check(candidate)``: all split, none refused, and right answers pass."""
    code = ("import re\ndef m(s):\n    return re.search('a', s)\nclass Solution:\n    def two(self, x):\n"
            "        return 2 * x\ndef pair(x):\n    return x, -x\n")
    tests = ["assert m('ab')", "assert not m('b') and m('a')", "s = Solution()\nassert s.two(2) == 4",
             "x = m('xa')\nassert x.start() == 1", "a, b = pair(3)\nassert (a, b) == (3, -3)",
             "def check(candidate):\n    assert candidate(5) == 10\ncheck(Solution().two)"]
    assert all(asserts.split_asserts(t)[1] and not asserts.split_asserts(t)[2] for t in tests)
    assert run_tests(code, tests) == (len(tests), len(tests), {})
    wrong = code.replace("2 * x", "x").replace("re.search('a', s)", "None").replace("x, -x", "x, x")
    assert run_tests(wrong, tests)[0] == 0


@needs_sandbox
def test_asserts_judged_outside_match_the_same_asserts_run_plainly() -> None:
    """A reference: the rewritten asserts pass exactly when Python's own do, across value types."""
    code = ("import collections, math\n"
            "def f(k):\n    return {'t': (1, 2), 'l': [1, [2.5]], 's': {1, 2}, 'fs': frozenset({3}),\n"
            "            'd': {'a': (1,)},\n"
            "            'od': collections.OrderedDict(a=1), 'c': collections.Counter('aab'), 'b': b'\\x00x',\n"
            "            'x': 1 + 2j, 'n': None, 'tf': True, 'i': 10 ** 30, 'nan': math.nan, 'u': 'é',\n"
            "            'big': math.factorial(3000)}[k]\n")
    cases = ["f('t') == (1, 2)", "f('t') == [1, 2]", "f('l') == [1, [2.5]]", "f('s') == {2, 1}", "f('fs') == {3}",
             "f('d') == {'a': (1,)}", "f('od') == {'a': 1}", "f('c') == {'a': 2, 'b': 1}", "f('b') == b'\\x00x'",
             "f('x') == 1 + 2j", "f('n') == None", "f('tf') == 1", "f('i') == 10 ** 30",
             "f('i') == 1000000000000000000000000000000",
             "f('nan') == float('nan')", "f('u') == 'é'", "(1, 2) == f('t')", "f('s') == set()", "f('tf') == False",
             # judged outside with arithmetic and builtins around the calls
             "abs(f('l')[1][0] - 2.4) < 0.2", "abs(f('l')[1][0] - 2.4) < 0.05", "math.isclose(f('l')[1][0], 2.5)",
             "sorted(f('s'), reverse=True) == [2, 1]", "len(f('c')) == 2", "f('n') is None", "f('tf') is True",
             "2 in f('s')", "not f('n')", "f('i') // 10 ** 29 == 10", "round(f('x').real) == 1 == f('t')[0]",
             "sorted(f('d'), key=len) == ['a']", "f('x') ** 2 == -3 + 4j", "{**f('d')} == {'a': (1,)}",
             "type(f('t')) == tuple", "f('t') and f('s')", "f('big') == math.factorial(3000)",
             "isinstance(f('i'), int) and not isinstance(f('l'), (tuple, set))", "f('tf')", "f('n')",
             "f('tf') and f('nan') == 0"]
    tests = [f"assert {case}" for case in cases]
    inside = [t for t in tests if asserts.split_asserts(t)[2]]
    assert inside == ["assert {**f('d')} == {'a': (1,)}", "assert f('big') == math.factorial(3000)"]  # run inside
    ns: dict = {}
    exec(code, ns)
    plain = [bool(eval(case, ns)) for case in cases]
    got = run_tests(code, tests, trust_inside_checks=True)
    assert got[:2] == (sum(plain), len(cases)), (got, [c for c, p in zip(cases, plain, strict=True) if not p])
    failing = [t for t, p in zip(tests, plain, strict=True) if not p]
    assert len(failing) == 7 and run_tests(code, failing)[0] == 0  # and it is those that fail
    assert run_tests(code, tests)[0] == sum(plain) - 2  # by default the two judged inside fail closed


def test_values_from_the_solution_cannot_make_the_judge_work_without_bound() -> None:
    """The judge rebuilds reported values from builtin types only and refuses what would blow up."""
    src = ("assert 2 ** f(1) == 4\nassert f(2) * 10 ** 4 == ''\nassert f(3) == [1]\nassert f(4) == 2 ** 20000\n"
           "assert f(5) % 7 == ''")
    _, table, _ = asserts.split_asserts(src)
    assert asserts.judge(table[0], {"t": [2]}) and not asserts.judge(table[1], {"t": ["x"]})
    assert asserts.judge(table[3], {"t": [{"i": format(2 ** 20000, "x")}]})  # past JSON's 4300 digits
    with pytest.raises(ValueError, match="size limit"):
        asserts.judge(table[0], {"t": [10 ** 7]})
    with pytest.raises(ValueError, match="size limit"):
        asserts.judge(table[1], {"t": ["x" * 1000]})
    assert not asserts.judge(table[4], {"t": ["%5d"]})
    _, more, _ = asserts.split_asserts("assert round(f(1), f(2)) == 0\nassert f(3) % f(4) == 0\n"
                                       "assert sum(f(5), []) == [0]")
    assert asserts.judge(more[0], {"t": [34, -2]}) and asserts.judge(more[2], {"t": [[[0], []]]})
    for k, values in ((0, [5, -10 ** 9]), (1, [{"i": "f" * 300000}, {"i": "f" * 100000}])):  # 10**10**9; quadratic
        with pytest.raises(ValueError, match="size limit"):
            asserts.judge(more[k], {"t": values})
    assert not asserts.judge(more[2], {"t": [[[0]] * 300000]})  # linear: Python's sum() copies 45e9 items
    for bomb in ("%999999999d", "%.999999999f", "%*d", b"%(a)1000000000s"):  # a 1 GB string, built here
        with pytest.raises(ValueError, match="size limit"):
            asserts.judge(table[4], {"t": [bomb if isinstance(bomb, str) else {"b": bomb.hex()}]})
    for bad in ({"t": [{"q": 1}]}, {"t": [{"f": 1}]}, [1], {"t": [{"x": "TypeError: a Foo"}]},
                {"t": [{"d": [[[1], 2]]}]}):  # unknown tag, bad float, not a tuple, unencodable, unhashable key
        with pytest.raises((ValueError, TypeError)):
            asserts.judge(table[2], bad)


@needs_sandbox
def test_three_hundred_passing_asserts_score_one_quickly() -> None:
    code = "def inc(x):\n    return x + 1\n"
    asserts = [f"assert inc({i}) == {i + 1}" for i in range(300)]
    t0 = time.monotonic()
    assert run_tests(code, "\n".join(asserts)) == (1, 1, {})
    assert run_tests(code, asserts) == (300, 300, {})  # one test each, one sandbox process
    assert time.monotonic() - t0 < 15
    broken = asserts[:150] + ["import os\nos._exit(0)"] + asserts[150:]  # a test that dies: the rest still run
    passed, total, detail = run_tests(code, broken)
    assert (passed, total) == (300, 301) and "test 150" in detail["error"]



@needs_sandbox
def test_a_hung_solution_or_a_first_failure_ends_the_row_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """A solution whose own code hangs fails every test after one timeout, not one per test; with
    ``stop_at_first_failure`` (all-or-nothing rewards) the tests after a failure never run."""
    runs: list[list[dict]] = []
    real = sandbox._run_sandbox

    def recording(iso, payload, on_message, **kw):
        seen: list[dict] = []
        runs.append(seen)
        return real(iso, payload, lambda m: seen.append(m) or on_message(m), **kw)

    monkeypatch.setattr(sandbox, "_run_sandbox", recording)
    passed, total, detail = run_tests("while True:\n    pass\n", ["assert f() == 1"] * 5, timeout_s=1)
    assert (passed, total) == (0, 5) and "the solution's own code: timed out" in detail["error"] and len(runs) == 1
    runs.clear()
    tests = [{"input": "1", "output": "wrong"}] + [{"input": "slow", "output": ""}] * 4
    got = run_tests("import time\nif input() == 'slow':\n    time.sleep(100)\nprint(1)", tests, timeout_s=30,
                    stop_at_first_failure=True)
    assert got == (0, 5, {"error": "test 0: wrong output"})
    assert len(runs) == 1 and [m["done"] for m in runs[0] if "done" in m] == [0]

# --- bounded everything -------------------------------------------------------------------------------

def _wait_gone(pids: set[int], seconds: float = 10.0) -> set[int]:
    deadline = time.monotonic() + seconds
    while True:
        left = {p for p in pids if Path(f"/proc/{p}").exists() and "State:\tZ" not in _status(p)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "State:\tZ"


@needs_sandbox
def test_fork_bomb_memory_sleep_and_flood_are_bounded_and_leave_nothing(outside) -> None:
    before_tmp = set(Path(tempfile.gettempdir()).glob("areal-sandbox-*"))
    rss0 = resident_mib()
    t0 = time.monotonic()
    name = f"areal-bomb{os.getpid() % 100000}"
    bomb = run_program("import ctypes, os\nctypes.CDLL(None).prctl(15, " + repr(name.encode()) + ", 0, 0, 0)\n"
                       "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", timeout_s=2)
    assert bomb["timed_out"] and time.monotonic() - t0 < 12
    assert _wait_gone(_named(name)) == set()
    assert outside["sentinel"].poll() is None
    if isolation.detect().process_limit_binds:  # bwrap's init, the harness and the program count
        forks = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        if os.fork() == 0:\n"
                 "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
                 "        break\nprint(n)")
        assert run_program(forks, max_processes=8)["stdout"] == "5\n"
    fill = ("import os\nn = 0\nfor d in ('/', '/usr', '/dev', '/dev/shm', '/tmp'):\n    for i in range(8):\n"
            "        try:\n            open(f'{d}/f{i}', 'wb').write(b'x' * (15 << 20))\n            n += 15\n"
            "        except OSError:\n            break\nopen('/dev/null', 'w').write('x')\nprint(n)")
    cap = (isolation.TMPFS_BYTES + isolation.SHM_BYTES) >> 20  # files are memory: only the capped tmpfs take them
    assert 45 <= int(run_program(fill)["stdout"]) <= cap  # 540 MiB before: bwrap's root and /dev had no cap
    alloc = run_program("x = bytearray(2 << 30)\nprint('allocated')", memory_mb=512)
    assert alloc["returncode"] != 0 and "allocated" not in alloc["stdout"] and "MemoryError" in alloc["stderr"]
    t0 = time.monotonic()
    assert run_program("import time\ntime.sleep(100)", timeout_s=1)["timed_out"]
    assert time.monotonic() - t0 < 12
    flood = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    passed, _, detail = run_tests(flood, [{"input": "", "output": "x"}], timeout_s=10)
    assert passed == 0 and "MiB of output" in detail["error"]
    assert run_tests(flood, "assert f() == 1", timeout_s=1)[0] == 0  # a flood to the harness's own stdout
    assert resident_mib() - rss0 < 64  # the output was never held whole here
    assert set(Path(tempfile.gettempdir()).glob("areal-sandbox-*")) == before_tmp


@needs_sandbox
def test_a_pool_timeout_that_kills_the_worker_leaves_no_sandbox_behind() -> None:
    """The pool's own timeout (shorter here than the sandbox's) kills the worker mid-run: the
    sandbox dies with it, all its processes, and no temporary directory is left."""
    import asyncio

    from areal_jax.rewards import RewardConfig, RewardPool

    name = f"areal-orph{os.getpid() % 100000}"
    code = ("import ctypes, os, time\nctypes.CDLL(None).prctl(15, " + repr(name.encode()) + ", 0, 0, 0)\n"
            "for _ in range(3):\n    os.fork()\ntime.sleep(100)\n")
    before_tmp = set(Path(tempfile.gettempdir()).glob("areal-sandbox-*"))

    async def go():
        with RewardPool(RewardConfig(name="tests.rewards.fns:sandboxed", num_workers=1, timeout_s=3.0)) as pool:
            call = asyncio.ensure_future(pool.score("p", code, {"seconds": 60}, row_id="orphan"))
            running: set[int] = set()
            while len(running) < 8 and not call.done():  # the sandbox and its 7 forks, seen while the call runs
                await asyncio.sleep(0.05)
                running = _named(name)
            return await call, running

    r, running = asyncio.run(go())
    assert r.reward == 0.0 and "timed out" in r.error
    assert len(running) == 8, running
    assert _wait_gone(running) == set()
    assert set(Path(tempfile.gettempdir()).glob("areal-sandbox-*")) == before_tmp


def _named(comm: str) -> set[int]:
    """Live processes whose name (``prctl(PR_SET_NAME)``, 15 characters) is ``comm``."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == comm[:15]:
                if "State:\tZ" not in _status(int(entry)):
                    found.add(int(entry))
        except OSError:
            continue
    return found


# --- ordinary work still works ------------------------------------------------------------------------

@needs_sandbox
def test_right_answers_pass_with_stdin_files_and_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AREAL_TEST_SECRET_KEY", "s3cr3t")
    code = ("import json, os\nn = int(input())\nopen('scratch.txt', 'w').write(str(n * 2))\n"
            "print(json.dumps({'double': int(open('scratch.txt').read()), 'env': sorted(os.environ)}))")
    r = run_program(code, "21")
    assert r["returncode"] == 0 and not r["timed_out"], r
    out = json.loads(r["stdout"])
    assert out["double"] == 42 and "AREAL_TEST_SECRET_KEY" not in out["env"]
    tests = [{"input": f"{i} {i + 1}", "output": str(2 * i + 1)} for i in range(30)]
    assert run_tests("a, b = map(int, input().split())\nprint(a + b)", tests) == (30, 30, {})
    slow = [{"input": "", "output": "done"}] * 3  # three tests, each most of its timeout: the row budget fits them
    assert run_tests("import time\ntime.sleep(1.0)\nprint('done')", slow, timeout_s=2.5)[0] == 3
    fill = ("import os\nif input() == 'fill':\n    for i in range(5):\n"  # 75 MiB, past the 64 MiB work dir
            "        try:\n            open(f'f{i}', 'wb').write(b'x' * (15 << 20))\n        except OSError:\n"
            "            pass\nprint(len(os.listdir('.')))\n")
    assert run_tests(fill, [{"input": "fill", "output": "5"}, {"input": "x", "output": "0"}]) == (2, 2, {})
    exits = [{"input": "5", "output": "5"}, {"input": "0", "output": "0"}]  # exit() and quit() without `site`
    assert run_tests("n = input()\nprint(n)\nexit() if n == '5' else quit(0)\nprint('not here')", exits)[0] == 2
    wrong = run_tests("print(int(input()) * 3)", [{"input": "1", "output": "3"}, {"input": "2", "output": "4"}])
    assert wrong == (1, 2, {"error": "test 1: wrong output"})


def test_without_isolation_code_rewards_refuse_with_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_jax.rewards import RewardConfig, RewardPool

    monkeypatch.setattr(isolation, "_candidates", lambda: [])
    isolation.detect.cache_clear()
    try:
        with pytest.raises(isolation.SandboxUnavailable, match="apt-get install -y bubblewrap"):
            run_tests("print(1)", [{"input": "", "output": "1"}])
        with pytest.raises(isolation.SandboxUnavailable, match="reward.unsandboxed"):
            RewardPool(RewardConfig(name="code"))
        line = RewardConfig(name="code", unsandboxed=True).preflight()
        assert "NONE" in line
        # the opt-out still gets the harness: its nonce, output caps and timeouts
        assert run_tests("print(int(input()) + 1)", [{"input": "1", "output": "2"}], unsandboxed=True)[0] == 1
        assert run_tests(CHEATS["os._exit(0) at load"], TESTS, unsandboxed=True)[0] == 0
    finally:
        isolation.detect.cache_clear()


def test_training_with_code_rewards_and_no_isolation_stops_first_saying_how_to_get_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_jax.cli import main

    monkeypatch.setattr(isolation, "_candidates", lambda: [])
    isolation.detect.cache_clear()
    try:
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(ROOT / "configs" / "demo.yaml"), f"run_dir={tmp_path}", "reward.name=code"])
    finally:
        isolation.detect.cache_clear()
    message = str(e.value.code)
    assert message.startswith("areal-jax train: code rewards refuse") and "apt-get install -y bubblewrap" in message
    assert not (tmp_path / "base").exists() and not (tmp_path / "logs").exists()  # before any model or server


def test_the_only_writable_places_are_capped_and_older_bubblewrap_drops_what_it_lacks() -> None:
    argv = isolation._bwrap_args("bwrap", "/py/bin/python", "/py", "/py", False)
    writable = [argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"]
    assert writable == ["/dev/shm", "/tmp"] and all(argv[argv.index(d) - 3] == "--size" for d in ("/dev/shm", "/tmp"))
    assert argv[argv.index("--") - 4:argv.index("--")] == ["--remount-ro", "/", "--chdir", "/tmp"]
    older = isolation._without(argv, {"--disable-userns": 0, "--size": 1, "/dev/shm": -1})
    assert "--size" not in older and "/dev/shm" not in older and "--disable-userns" not in older
    assert older[older.index("--dev"):older.index("--")] == ["--dev", "/dev", "--tmpfs", "/tmp", "--remount-ro", "/dev",
                                                             "--remount-ro", "/", "--chdir", "/tmp"]


def test_the_sandbox_refuses_a_mix_of_test_kinds() -> None:
    with pytest.raises(ValueError, match="not a mix"):
        run_tests("x = 1", ["assert x == 1", {"input": "", "output": ""}], unsandboxed=True)



@needs_sandbox
def test_the_code_pool_reports_its_isolation_and_scores_a_300_assert_row() -> None:
    import asyncio

    from areal_jax.rewards import RewardConfig, RewardPool

    answer = "```python\ndef inc(x):\n    return x + 1\n```"
    tests = [f"assert inc({i}) == {i + 1}" for i in range(300)]

    async def go():
        with RewardPool(RewardConfig(name="code", num_workers=1)) as pool:
            assert pool.isolation.startswith("code sandbox: bubblewrap")
            return await pool.score("p", answer, {"tests": tests}, row_id="many")

    r = asyncio.run(go())
    assert r.error is None and r.reward == 1.0 and r.extra["passed"] == 300, r
