"""Test-wide set-up: eight fake CPU devices, so mesh tests run on any machine; a compilation
cache shared by every test process; compiled programs released after each test module; and
`serial` tests run alone when the suite runs on several workers (pytest-xdist).

XLA reads the flag when the backend starts, so it must be set before anything imports jax.

Every program XLA:CPU compiles keeps its machine code in its own memory mappings for as long as
JAX's caches hold the executable. A whole suite in one process compiles thousands of programs;
without the release below the process passed 60,000 mappings and XLA crashed compiling once it
reached the kernel's per-process limit (vm.max_map_count, 65,530 by default). The persistent
cache makes the programs that later modules (and the servers and runs that tests start as
child processes) compile again cheap to load.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags.devices(8))  # compiled fast: see tests/xla_flags.py
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Child processes (servers, `areal-jax train` runs) inherit these through the environment.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))  # least recently used entries go first


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    """After each test module, drop JAX's compiled programs (and with them their mappings)."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


def _lock_dir() -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "local")
    path = Path(tempfile.gettempdir()) / f"areal-jax-tests-{run}"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a") as fh:
        fcntl.flock(fh, mode)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist a test marked ``serial`` (it asserts on timing or on two things running
    at once) waits until no other worker is inside a test and keeps the others out while it runs
    (set-up and tear-down included). A turnstile lock lets a waiting serial test in before new
    tests of the other workers start."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    d = _lock_dir()
    if item.get_closest_marker("serial"):
        with _flock(d / "turnstile", fcntl.LOCK_EX), _flock(d / "room", fcntl.LOCK_EX):
            yield
        return
    with _flock(d / "turnstile", fcntl.LOCK_EX):
        pass
    with _flock(d / "room", fcntl.LOCK_SH):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow end-to-end tests first, the rest after in reverse path order (the many
    small files of ``algo``, ``controller`` and ``data`` last): on several workers, one file at a
    time each, long files started late would leave one worker finishing alone. Order within a
    file is kept."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    files = sorted({item.path for item in items}, reverse=True)
    files.sort(key=lambda p: p not in slow)
    rank = {p: i for i, p in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])
