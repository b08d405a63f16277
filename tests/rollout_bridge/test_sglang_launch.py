"""Launching real SGLang servers: every flag of the command line exists, with the right arity, in
the pinned sglang version (read from the flag declarations in its wheel, fetched by
scripts/fetch_sglang_schema.sh; skipped without them), the config refuses what SGLang cannot do,
and a run configured for SGLang really starts ``python -m sglang.launch_server``."""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from areal_jax.trainer.rollout import open_rollout
from areal_jax.trainer.run_config import load_run_config
from rollout_bridge.launcher import LaunchError
from rollout_bridge.sglang_launch import SGLANG_VERSION, SGLangOptions, sglang_command

ARGS_DIR = Path(__file__).resolve().parents[2] / ".cache" / "sglang" / "server_args"


def sglang_flags(args_dir: Path) -> dict[str, bool]:
    """Every ``sglang.launch_server`` flag -> whether it is a switch (takes no value): from the
    ``A[type, "help"]`` / ``A[type, Arg(...)]`` fields the wheel turns into flags, and its explicit
    ``parser.add_argument`` calls."""
    flags: dict[str, bool] = {}
    for path in sorted(args_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                ann = node.annotation
                if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "A"
                        and isinstance(ann.slice, ast.Tuple) and len(ann.slice.elts) >= 2):
                    continue
                kind, meta = ast.unparse(ann.slice.elts[0]), ann.slice.elts[1]
                names = ["--" + node.target.id.replace("_", "-")]
                if isinstance(meta, ast.Call) and getattr(meta.func, "id", None) == "Arg":
                    kw = {k.arg: k.value for k in meta.keywords}
                    if "no_cli" in kw and ast.literal_eval(kw["no_cli"]):
                        continue
                    if "cli_name" in kw:
                        names = [ast.literal_eval(kw["cli_name"])]
                    names += ast.literal_eval(kw["aliases"]) if "aliases" in kw else []
                    switch = kind == "bool" and "action" not in kw
                elif isinstance(meta, ast.Constant) and isinstance(meta.value, str):
                    switch = kind == "bool"
                else:  # derived fields and docs: not flags
                    continue
                flags.update(dict.fromkeys(names, switch))
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                action = next((k.value for k in node.keywords if k.arg == "action"), None)
                switch = isinstance(action, ast.Constant) and action.value in ("store_true", "store_false")
                for a in node.args:
                    if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                        flags[a.value] = switch
    return flags


@pytest.fixture(scope="module")
def flags() -> dict[str, bool]:
    if not (ARGS_DIR / "server_args.py").exists():
        pytest.fail(f"sglang's flag declarations are missing at {ARGS_DIR}: run scripts/fetch_sglang_schema.sh "
                    "(scripts/test.sh does) to check our launch command against them")
    found = sglang_flags(ARGS_DIR)
    # the reader itself: it finds SGLang's flags, their aliases and switches, and nothing made up
    assert len(found) > 300
    assert found["--tensor-parallel-size"] is False and found["--skip-server-warmup"] is True
    assert "--model-dir" not in found and "--tensor-parallel" not in found
    return found


def test_every_flag_we_write_exists_in_the_pinned_sglang(flags: dict[str, bool]) -> None:
    opts = SGLangOptions(tp_size=2, mem_fraction_static=0.7, dtype="bfloat16", context_length=4096)
    cmd = sglang_command(opts, "/models/qwen", 30001, seed=3, api_key="k", weight_version=5)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    args, seen = cmd[3:], []
    while args:
        flag = args.pop(0)
        assert flag in flags, f"{flag} is not a flag of sglang's launch_server"
        if not flags[flag]:
            assert args and not args[0].startswith("--"), f"{flag} takes a value"
            seen.append((flag, args.pop(0)))
    assert dict(seen) == {"--model-path": "/models/qwen", "--host": "127.0.0.1", "--port": "30001",
                          "--tp-size": "2", "--dtype": "bfloat16", "--random-seed": "3", "--weight-version": "5",
                          "--mem-fraction-static": "0.7", "--context-length": "4096", "--api-key": "k"}


def test_one_sglang_version_everywhere() -> None:
    """The extra installs, the flag check reads, and the command is written for the same release."""
    root = Path(__file__).resolve().parents[2]
    assert f'sglang = ["sglang=={SGLANG_VERSION}"]' in (root / "pyproject.toml").read_text()
    fetch = (root / "scripts" / "fetch_sglang_schema.sh").read_text()
    assert f'SGLANG_VERSION="${{SGLANG_VERSION:-{SGLANG_VERSION}}}"' in fetch


def test_sglang_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rollout.weight_sync=disk"):
        load_run_config(None, ["rollout.backend=sglang"])
    with pytest.raises(ValueError, match=r"num_servers x tp_size = 4"):
        load_run_config(None, ["rollout.backend=sglang", "rollout.weight_sync=disk", "rollout.num_servers=2",
                               "rollout.sglang.tp_size=2", "rollout.server_devices=[0,1]"])
    with pytest.raises(ValueError, match="rollout.sglang.mem_fraction_static"):
        load_run_config(None, ["rollout.backend=sglang", "rollout.weight_sync=disk",
                               "rollout.sglang.mem_fraction_static=1.5"])
    with pytest.raises(ValueError, match="rollout.server_devices splits a host"):
        load_run_config(None, ["rollout.backend=servers", "rollout.servers=[a:1]", "rollout.server_devices=[0]"])


def test_a_run_configured_for_sglang_starts_sglang_launch_server(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The run starts ``python -m sglang.launch_server`` and, when it dies, the error names the
    server and quotes its log. Without sglang (as here) the server dies at its import; where sglang
    is installed, an empty ``sglang`` package first on the server's path makes it die the same way."""
    if importlib.util.find_spec("sglang") is not None:
        (tmp_path / "shadow" / "sglang").mkdir(parents=True)
        (tmp_path / "shadow" / "sglang" / "__init__.py").write_text("")  # no launch_server module
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))
    model = tmp_path / "m"
    model.mkdir()
    cfg = load_run_config(None, [f"run_dir={tmp_path / 'run'}", "rollout.backend=sglang", "rollout.weight_sync=disk",
                                 "rollout.startup_timeout_s=60", "rollout.api_key=secret"])

    async def start() -> None:
        async with open_rollout(cfg, model, tmp_path / "run" / "logs"):
            pass

    died = r"(?s)rollout server 0 .* exited.*No module named '?sglang"
    with pytest.raises(LaunchError, match=died):
        asyncio.run(start())
    first = (tmp_path / "run" / "logs" / "server-0.log").read_text().splitlines()[0]
    assert f"-m sglang.launch_server --model-path {model} --host 127.0.0.1 --port " in first
    assert "--api-key '***'" in first and "secret" not in first
