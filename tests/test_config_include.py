"""Composable configs: a file's ``include:`` list (paths relative to it, merged in order under its
own keys, recursively) and several ``--config`` files merged in order."""

from pathlib import Path

import pytest

from areal_jax.cli import _train_args
from areal_jax.config import ConfigError, read_config_file
from areal_jax.trainer.run_config import load_run_config


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_include_merges_in_order_under_the_files_own_keys(tmp_path: Path) -> None:
    _write(tmp_path / "presets/base.yaml", "algo: {eps_clip: 0.3, adv_norm: true}\nsteps: 7\n")
    _write(tmp_path / "presets/more.yaml", "include: [base.yaml]\nalgo: {eps_clip: 0.25, m2_threshold: 0.04}\n")
    run = _write(tmp_path / "runs/run.yaml", "include: [../presets/more.yaml]\nalgo: {eps_clip: 0.2}\n")
    assert read_config_file(run) == {"algo": {"eps_clip": 0.2, "adv_norm": True, "m2_threshold": 0.04}, "steps": 7}
    cfg = load_run_config(run, ["algo.eps_clip=0.1"])
    assert (cfg.algo.eps_clip, cfg.algo.adv_norm, cfg.algo.m2_threshold, cfg.steps) == (0.1, True, 0.04, 7)


def test_several_config_files_merge_in_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.yaml", "steps: 3\nbatch_size: 4\nalgo: {eps_clip: 0.3}\n")
    b = _write(tmp_path / "b.yaml", "include: [algo.yaml]\nsteps: 5\n")
    _write(tmp_path / "algo.yaml", "algo: {kl_coef: 0.01}\n")
    cfg = load_run_config([a, b])
    assert (cfg.steps, cfg.batch_size, cfg.algo.eps_clip, cfg.algo.kl_coef) == (5, 4, 0.3, 0.01)
    args = _train_args(["--config", str(a), "--config", str(b), "steps=9"], "areal-jax train")
    assert args.config == [str(a), str(b)] and load_run_config(args.config, args.overrides).steps == 9


def test_include_errors_name_the_file(tmp_path: Path) -> None:
    loop_a = _write(tmp_path / "a.yaml", "include: [b.yaml]\n")
    _write(tmp_path / "b.yaml", "include: [a.yaml]\n")
    with pytest.raises(ConfigError, match="cycle"):
        read_config_file(loop_a)
    missing = _write(tmp_path / "m.yaml", "include: [nowhere.yaml]\n")
    with pytest.raises(ConfigError, match=r"nowhere\.yaml does not exist \(included from .*m\.yaml\)"):
        read_config_file(missing)
    bad = _write(tmp_path / "bad.yaml", "include: {algo: x}\n")
    with pytest.raises(ConfigError, match="'include' must be a list"):
        read_config_file(bad)


def test_algo_presets_compose_into_a_run(tmp_path: Path) -> None:
    presets = Path(__file__).parents[1] / "configs" / "algo"
    run = _write(tmp_path / "run.yaml", f"include: [{presets / 'm2po.yaml'}]\nrollout: {{max_new_tokens: 64}}\n")
    cfg = load_run_config(run)
    assert (cfg.algo.m2_threshold, cfg.algo.eps_clip, cfg.algo.reward_scale) == (0.04, 0.0, 10.0)
    dapo = load_run_config([run, presets / "dapo.yaml"], ["algo.overlong_penalty.buffer_len=16"])
    assert dapo.algo.overlong_penalty.max_len == 64  # follows rollout.max_new_tokens
    with pytest.raises(ValueError, match="buffer_len"):
        load_run_config([run, presets / "dapo.yaml"])  # 512 > 64 new tokens
