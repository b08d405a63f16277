"""Every Python block of README.md runs as written, in order, in one namespace, in a fresh
directory; the Rollout block talks to a server started with the README's own `serve` command."""

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def _serve_command() -> list[str]:
    line = next(ln for b in _blocks("bash") for ln in b.splitlines() if " serve " in ln)
    args = line.split("#")[0].split()
    assert args[0].endswith("areal-jax") and args[1] == "serve"
    return [sys.executable, "-m", "areal_jax.cli", *args[1:]]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("the README's server did not come up")


@pytest.mark.slow
def test_readme_python_blocks_run_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 5
    monkeypatch.delenv("AREAL_JAX_COMPILE_THREADS", raising=False)  # as a user runs them: the servers' default
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": "__main__"}
    server = None
    try:
        for i, block in enumerate(blocks):
            if "HttpRolloutClient" in block and server is None:
                cmd = _serve_command()
                port = int(cmd[cmd.index("--port") + 1])
                # The command as written; only the shapes its requests meet compile (threads 0, as
                # in the rest of the suite): compiling the others in the background cost the suite
                # CPU, and SIGTERM waits for a compile in flight (10 s of this test, warm cache).
                server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          env={**os.environ, "PYTHONPATH": str(ROOT), "AREAL_JAX_COMPILE_THREADS": "0"})
                _wait_healthy(port, server)
            try:
                exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"README python block {i + 1} failed:\n{block}") from e
    finally:
        if server is not None:
            server.terminate()
            # It stops once a compile in flight ends (XLA cannot be interrupted): 20 s was too
            # little on a loaded 2-core machine (a fresh-clone CI run, 2026-11-28, with the
            # server's background compiles on).
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(20)
                raise AssertionError("the README's server did not stop within 120 s of SIGTERM") from None
    assert namespace["logits"].shape == (1, 8, 128)
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "runs" / "readme" / "metrics.jsonl").exists()
    assert namespace["stats"]["loss_tokens"] == 4
