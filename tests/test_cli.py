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


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "areal_jax.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, env=env)


def test_help_config_lists_every_key_with_its_docstring() -> None:
    import dataclasses

    from areal_jax.config import _dataclass_in, field_docs
    from areal_jax.trainer.run_config import RunConfig

    out = _cli("train", "--help-config")
    assert out.returncode == 0, out.stderr
    shown = {line.split(":")[0] for line in out.stdout.splitlines() if line and not line.startswith(" ")}

    def leaves(cls: type, prefix: str = "") -> list[str]:  # every key, optional sections expanded
        import typing

        hints = typing.get_type_hints(cls)
        out = []
        for f in dataclasses.fields(cls):
            nested = _dataclass_in(hints[f.name])
            out += leaves(nested, f"{prefix}{f.name}.") if nested else [prefix + f.name]
        return out

    keys = leaves(RunConfig)
    assert len(keys) > 150 and set(keys) <= shown
    lines = out.stdout.splitlines()
    undocumented = [ln.split(":")[0] for ln, nxt in zip(lines, [*lines[1:], ""], strict=True)
                    if ln.split(":")[0] in keys and not nxt.startswith("    ")]
    assert undocumented == []  # every key says what it is
    assert "rollout.max_staleness: int = 2\n    eta: no trained token" in out.stdout
    assert "\n    ".join(field_docs(RunConfig)["steps"].splitlines()) in out.stdout  # each line indented
    # a section alone, without --config
    part = _cli("train", "--help-config", "rollout.local")
    assert part.returncode == 0 and "rollout.local.placement" in part.stdout
    assert "rollout.max_staleness" not in part.stdout
    bad = _cli("train", "--help-config", "rollot")
    assert bad.returncode != 0 and "no config key starts with 'rollot'" in bad.stderr


def test_print_config_imports_modules_beside_the_config(tmp_path: Path) -> None:
    """A reward and a workflow written beside the config import by the names the config gives
    them, wherever ``areal-jax train`` runs from; ``--print-config`` shows the resolved config
    after checking them, and a misspelt one stops it naming the key, before anything starts."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "my_reward.py").write_text("def score(prompt, completion, **fields):\n    return 1.0\n")
    (folder / "my_flows.py").write_text("async def episode(client, row):\n    return []\n")
    (folder / "run.yaml").write_text("reward:\n  name: my_reward:score\nrollout:\n  workflow: my_flows:episode\n")
    out = _cli("train", "--config", str(folder / "run.yaml"), "--print-config", "steps=7")
    assert out.returncode == 0, out.stderr
    import yaml

    cfg = yaml.safe_load(out.stdout)
    assert cfg["steps"] == 7 and cfg["reward"]["name"] == "my_reward:score"
    assert cfg["rollout"]["max_staleness"] == 2  # defaults resolved
    bad = _cli("train", "--config", str(folder / "run.yaml"), "--print-config", "reward.name=my_rewardz:score")
    assert bad.returncode != 0
    assert "reward.name='my_rewardz:score': cannot import it" in bad.stderr and "Traceback" not in bad.stderr


def test_print_config_loads_no_trainer_engine_or_server() -> None:
    """``--print-config`` and ``--help-config`` load the config modules only: before, the check
    went through ``trainer.rl``, which imports the trainer, the engine and the HTTP stack
    (1.07-1.12 s of CPU a call before, 0.87-0.97 s now)."""
    code = ("import sys\nfrom areal_jax.cli import main\n"
            "try:\n    main(['train', '--config', 'configs/demo.yaml', '--print-config'])\n"
            "except SystemExit:\n    pass\n"
            "heavy = [m for m in ('areal_jax.trainer.rl', 'areal_jax.trainer.train_step',"
            " 'areal_jax.inference.engine', 'rollout_bridge.server', 'rollout_bridge.client') if m in sys.modules]\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert "HEAVY []" in out.stderr, out.stderr
    assert "steps:" in out.stdout
