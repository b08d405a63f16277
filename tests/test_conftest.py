"""The suite's own machinery: a pytest started by a test never takes the workers' locks."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path


def test_a_child_pytest_with_a_workers_environment_does_not_wait_on_the_workers_locks() -> None:
    """A serial test on another worker holds the turnstile while it waits for the room; a pytest
    that a test starts inherits PYTEST_XDIST_* and must run anyway (it once deadlocked CI)."""
    run = f"check-{uuid.uuid4().hex}"
    lock_dir = Path(tempfile.gettempdir()) / f"areal-jax-tests-{run}"
    lock_dir.mkdir()
    env = {**os.environ, "PYTEST_XDIST_WORKER": "gw9", "PYTEST_XDIST_TESTRUNUID": run}
    root = Path(__file__).resolve().parents[1]
    try:
        with open(lock_dir / "turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # what a serial test waiting for the room holds
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_trivial"],
                cwd=root, env=env, capture_output=True, text=True, timeout=120)
    finally:
        for f in lock_dir.iterdir():
            f.unlink()
        lock_dir.rmdir()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


def test_trivial() -> None:
    """Run by the test above in a child pytest."""
    assert sum([1, 2]) == 3
