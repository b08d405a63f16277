"""Config loading: YAML + key=value overrides into nested dataclasses, with clear errors."""

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from areal_jax.config import ConfigError, load_config, parse_overrides
from sharding import MeshConfig


@dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    """Learning rate."""
    schedule: str = "constant"


@dataclass(frozen=True)
class Run:
    name: str = "run"
    steps: int = 10
    eval_every: int | None = None
    optim: Optim = field(default_factory=Optim)
    mesh: MeshConfig = field(default_factory=MeshConfig)


def test_defaults_yaml_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("steps: 50\noptim:\n  lr: 0.01\nmesh:\n  tensor: 2\n")
    cfg = load_config(Run, f, ["optim.lr=3e-4", "mesh.fsdp=-1", "eval_every=5"])
    assert cfg == Run(steps=50, eval_every=5, optim=Optim(lr=3e-4), mesh=MeshConfig(fsdp=-1, tensor=2))
    assert load_config(Run) == Run()
    assert load_config(Run, overrides=["optim.lr=1"]).optim.lr == 1.0  # int widened to float


def test_unknown_key_names_closest_match(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'optim\.lrr'.*did you mean 'lr'"):
        load_config(Run, overrides=["optim.lrr=1"])
    f = tmp_path / "c.yaml"
    f.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match=r"'stepz'.*did you mean 'steps'"):
        load_config(Run, f)


def test_wrong_types_and_bad_syntax(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'steps': expected int, got 'many'"):
        load_config(Run, overrides=["steps=many"])
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=r"'eval_every': .*'soon'"):
        load_config(Run, overrides=["eval_every=soon"])


def test_build_md_run_configs_load(tmp_path: Path) -> None:
    """Every run config BUILD.md shows (a YAML block whose first line names its file) is a valid
    RunConfig as written: no unknown key, no wrong type."""
    import re

    from areal_jax.trainer.run_config import load_run_config

    text = (Path(__file__).resolve().parents[1] / "BUILD.md").read_text()
    blocks = re.findall(r"```yaml\n# (\S+\.yaml)\n(.*?)```", text, re.S)
    assert {name for name, _ in blocks} >= {"my_run.yaml", "mixed.yaml"}
    for name, body in blocks:
        (tmp_path / name).write_text(body)
        cfg = load_run_config(tmp_path / name)
        assert cfg.model.path, name


def test_run_config_advises_against_one_step_decoupled_ppo_at_large_staleness() -> None:
    from areal_jax.trainer.run_config import STALE_ONE_STEP, load_run_config

    def advice(*overrides: str) -> list[str]:
        return load_run_config("configs/demo.yaml", ["rollout.mode=async", *overrides]).advisories()

    eta = f"rollout.max_staleness={STALE_ONE_STEP}"
    (msg,) = advice(eta)
    assert "algo.ppo_n_minibatches" in msg and f"max_staleness {STALE_ONE_STEP}" in msg
    assert advice(f"rollout.max_staleness={STALE_ONE_STEP - 1}") == []
    assert advice(eta, "algo.ppo_n_minibatches=2") == []
    assert advice(eta, "algo.use_decoupled_loss=false") == []
    assert advice(eta, "rollout.mode=sync") == []  # a synchronous run is never stale
    assert load_run_config("configs/demo.yaml").advisories() == []


def test_run_config_advises_against_one_step_decoupled_ppo_on_stale_data_at_a_large_lr() -> None:
    """Any staleness with one optimizer step per batch and no M2PO trust region: only the learning
    rate bounds a step on stale data, so a rate above ``STALE_ONE_STEP_LR`` is warned about (the
    issue's run: lr 1e-3, no gradient clip, ``max_staleness`` 1)."""
    from areal_jax.trainer.run_config import STALE_ONE_STEP, STALE_ONE_STEP_LR, load_run_config

    def advice(*overrides: str) -> list[str]:
        return load_run_config("configs/demo.yaml", ["rollout.mode=async", "rollout.max_staleness=1",
                                                     *overrides]).advisories()

    big = f"train.lr={STALE_ONE_STEP_LR * 10 / 3:g}"  # 1e-3
    (msg,) = advice(big, "train.grad_clip=null")
    assert "train.lr 0.001" in msg and "max_staleness 1" in msg and "clip never binds" in msg
    assert "algo.ppo_n_minibatches >= 2" in msg and "algo.m2_threshold" in msg
    assert advice(big) == [msg]  # a gradient clip does not bound it
    assert advice(f"train.lr={STALE_ONE_STEP_LR:g}") == []  # the demo's rate, seen stable
    assert advice(big, "algo.ppo_n_minibatches=2") == []
    assert advice(big, "algo.m2_threshold=0.04") == []
    assert advice(big, "algo.use_decoupled_loss=false") == []
    assert advice(big, "rollout.max_staleness=0") == [] and advice(big, "rollout.mode=sync") == []
    # At large staleness the staleness warning says it all, whatever the rate; M2PO answers it too.
    (large,) = advice(big, f"rollout.max_staleness={STALE_ONE_STEP}")
    assert f"max_staleness {STALE_ONE_STEP}" in large and "train.lr" not in large
    assert advice(f"rollout.max_staleness={STALE_ONE_STEP}", "algo.m2_threshold=0.04") == []


def test_run_config_says_tiny_options_do_nothing_beside_a_model_path(tmp_path: Path) -> None:
    from areal_jax.trainer.run_config import load_run_config

    # configs/demo.yaml builds a tiny model with tiny_options; pointing it at a checkpoint keeps them
    switched = ["model.tiny=null", f"model.path={tmp_path}"]
    (msg,) = load_run_config("configs/demo.yaml", switched).advisories()
    assert "model.tiny_options" in msg and "hidden_size" in msg and "model.tiny_options={}" in msg
    assert load_run_config("configs/demo.yaml", [*switched, "model.tiny_options={}"]).advisories() == []
