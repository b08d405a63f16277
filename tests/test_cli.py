"""The ``areal-jax`` command itself: its help lists every command."""

import subprocess
import sys
from pathlib import Path

from areal_jax.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_command() -> None:
    out = subprocess.run([sys.executable, "-m", "areal_jax.cli", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.split("commands:\n", 1)[1].splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS) and {"train", "eval", "serve", "demo", "bench"} <= set(listed)
    for name, what in COMMANDS.items():
        assert f"  {name:<6} {what}" in out.stdout
    # no command, or an unknown one: the same list, and a failing exit code
    bad = subprocess.run([sys.executable, "-m", "areal_jax.cli", "trian"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert bad.returncode == 2 and "commands:" in bad.stdout
