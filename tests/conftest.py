"""Test-wide set-up: eight fake CPU devices, so mesh tests run on any machine; a compilation
cache shared by every test process; compiled programs released after a test module once a
worker holds many memory mappings or much memory; and the files in order, longest first, for
the workers of pytest-xdist.

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
import gc
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import procmem, xla_flags

os.environ.setdefault("XLA_FLAGS", xla_flags.devices(8))  # compiled fast: see tests/xla_flags.py
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The servers and runs tests start meet a step shape or two each: compiling every other one in
# the background was most of an idle test server's CPU (test_rl_loop's two-server and sync runs:
# 64.2 and 60.4 CPU-s -> 53.1 and 52.8, interleaved, 2026-11-28). Tests of background compiles
# give their own thread count.
os.environ.setdefault("AREAL_JAX_COMPILE_THREADS", "0")
# Child processes (servers, `areal-jax train` runs) inherit these through the environment.
CACHE = Path(os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                                   str(Path(__file__).resolve().parents[1] / ".cache" / "jax-tests")))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# No size limit inside JAX: with one, every write takes a lock on the whole cache and lists it
# and reads every entry's access time to evict: 40 us of CPU an entry, so 0.14 s a write at the
# 3,500 entries a suite writes from empty (1.8 s on the loaded 2-core machine, against 0.2 ms
# without the limit), some 270 CPU-seconds a suite, one process at a time; every other process's
# reads queue behind the lock and give up after its 10 s timeout. The cache is bounded once per
# session instead (_bound_cache).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")
CACHE_BYTES = 2 << 30
# Python's full garbage collections walk every tracked object, and a worker's heap grows past
# 800,000 of them (JAX's caches of traced and compiled programs): its 50-60 full collections took
# 39-47 s of each worker's 710 (three workers, timed with gc.callbacks, 2026-11-29). None runs on
# its own now (a full collection comes after 1,000 younger ones, more than a module makes); each
# module ends with one instead, over what that module left (_release_compiled_programs).
gc.set_threshold(700, 10, 1000)


MAX_MAPPINGS = 20_000
"""A worker drops its compiled programs after a test module once it holds more memory mappings
than this (a third of the kernel's default limit; a module adds a few thousand at most) ..."""
MAX_RESIDENT = 4 << 30
"""... or more resident memory than this (three workers and the processes they start share the
machine)."""


def _too_big() -> bool:
    try:
        return procmem.mappings() > MAX_MAPPINGS or procmem.resident_bytes() > MAX_RESIDENT
    except OSError:  # not Linux: no per-process limit to keep under
        return False


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> Iterator[None]:
    """After a test module, drop JAX's compiled programs (and with them their mappings) once the
    process holds more than ``MAX_MAPPINGS`` mappings or ``MAX_RESIDENT`` bytes. Not after every
    module: that release (a full garbage collection of a heap full of traced programs) took 136
    CPU-s of a 22 CPU-minute suite (sampled with py-spy, 2026-11-28), and the modules after it
    traced again the programs they shared.

    Then the module's garbage is collected, and whatever it left alive is frozen out of the
    collector's view (``gc.freeze``): a later collection walks only what later modules make. With
    this (and no full collection within a module, above) the three workers spent 72 and 77 s in
    full collections against 125 s before (103 s freezing alone; whole suites, 2026-11-29).
    Cycles among frozen objects that die later are freed at the next release, which unfreezes
    first."""
    yield
    if _too_big():
        import jax

        gc.unfreeze()
        jax.clear_caches()
    gc.collect()
    gc.freeze()


def _is_worker(config: pytest.Config) -> bool:
    """True in a pytest-xdist worker process, False in the process that starts the workers."""
    return hasattr(config, "workerinput")


DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test file took in a whole-suite run on three workers (regenerate with
``python -m tests.durations JUNIT_XML`` from a run with ``--junitxml``); only the order of files
depends on it."""


def _bound_cache(limit: int = CACHE_BYTES) -> None:
    """Once the compilation cache passes ``limit`` bytes, delete its least recently written
    entries down to half of it (the suite writes a few hundred MB from empty)."""
    if not CACHE.is_dir():
        return
    entries = []
    for f in CACHE.iterdir():
        with contextlib.suppress(OSError):  # written or deleted meanwhile by another suite's process
            st = f.stat()
            entries.append((st.st_mtime, st.st_size, f))
    entries.sort()
    total = sum(size for _, size, _ in entries)
    if total <= limit:
        return
    for _, size, f in entries:  # oldest first
        if total <= limit // 2:
            break
        f.unlink(missing_ok=True)
        total -= size


def pytest_configure(config: pytest.Config) -> None:
    if not _is_worker(config):  # the main process, before any worker starts
        _bound_cache()
    # pytest-xdist's loadfile hands out files largest test count first unless told otherwise,
    # which would throw away the order chosen below (it started the 1-test files that take
    # minutes last, leaving one worker finishing alone).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def _file_seconds(items: list[pytest.Item]) -> dict[Path, float]:
    """Each file's measured seconds; a file not yet measured counts 30 s per slow test and 0.2 s
    per other test."""
    root = Path(__file__).resolve().parents[1]
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    guess: dict[Path, float] = {}
    for item in items:
        guess[item.path] = guess.get(item.path, 0.0) + (30.0 if item.get_closest_marker("slow") else 0.2)
    out = {}
    for path, g in guess.items():
        try:
            key = path.resolve().relative_to(root).as_posix()
        except ValueError:
            key = str(path)
        out[path] = float(measured.get(key, g))
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files longest first (by their measured time): on several workers, one file at a time each,
    a long file started late leaves one worker finishing alone while the others idle (the
    longest-processing-time-first rule). Order within a file is kept."""
    seconds = _file_seconds(items)
    files = sorted(seconds, key=lambda p: (-seconds[p], str(p)))
    rank = {p: i for i, p in enumerate(files)}
    items.sort(key=lambda item: rank[item.path])
