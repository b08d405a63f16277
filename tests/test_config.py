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


# --- every value checked at load, naming the key (issue 43) ------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    # a section given a scalar
    (["rollout=5"], r"config key 'rollout': expected a mapping \(the RolloutConfig section\), got 5"),
    # list and tuple elements
    (["rollout.stop_token_ids=[a, b]"], r"'rollout\.stop_token_ids\[0\]': expected int, got 'a'"),
    (["train.betas=[foo, 0.9]"], r"'train\.betas\[0\]': expected float, got 'foo'"),
    (["train.betas=[0.9]"], r"'train\.betas': expected 2 items, got 1"),
    (["train.length_buckets=[64, big]"], r"'train\.length_buckets\[1\]': expected int"),
    # ranges a server or the trainer would refuse much later
    (["rollout.max_staleness=-1"], r"rollout\.max_staleness must be >= 0"),
    (["rollout.max_new_tokens=0"], r"rollout\.max_new_tokens must be >= 1"),
    (["rollout.top_p=0"], r"rollout\.top_p must be in \(0, 1\]"),
    (["rollout.top_k=0"], r"rollout\.top_k must be -1 \(all\) or >= 1"),
    (["rollout.max_concurrent_rollouts=0"], r"rollout\.max_concurrent_rollouts must be >= 1"),
    (["rollout.stop_token_ids=[-3]"], r"rollout\.stop_token_ids must be token ids >= 0"),
    # free-form sections with a known shape
    (["model.tiny=tiny", "model.tiny_options.hidden_size=abc"],
     r"'model\.tiny_options\.hidden_size': expected int, got 'abc'"),
    (["model.tiny=tiny", "model.tiny_options.hiden_size=64"],
     r"'model\.tiny_options\.hiden_size'.*did you mean 'hidden_size'"),
    (["model.tiny=huge"], r"model\.tiny='huge': choose one of"),
    (["model.model_type=qwen9"], r"'model\.model_type': 'qwen9' is not one of"),
    (["rollout.workflow=multi_turn", "rollout.workflow_options.max_turn=3"],
     r"'rollout\.workflow_options\.max_turn'.*multi_turn.*did you mean 'max_turns'"),
    (["rollout.workflow=multi_turn", "rollout.workflow_options.max_turns=two"],
     r"'rollout\.workflow_options\.max_turns': expected int, got 'two'"),
    (["rollout.workflow=multi_turn", "rollout.workflow_options.max_turns=0"],
     r"rollout\.workflow_options\.max_turns must be >= 1"),
    (["rollout.workflow=single_turn", "rollout.workflow_options.max_turns=2"],
     r"'rollout\.workflow_options\.max_turns'.*single_turn; it takes no options"),
    (["rollout.workflow=agentic"], r"rollout\.workflow=agentic needs rollout\.workflow_options\.agent"),
    (["rollout.workflow=agentic", "rollout.workflow_options={agent: 'a.b:c', trajectory: tree}"],
     r"'rollout\.workflow_options\.trajectory': 'tree' is not one of \['concat', 'per_turn'\]"),
    # combinations that cannot work
    (["rollout.filter_uniform_reward=true", "rollout.group_size=1"],
     r"rollout\.filter_uniform_reward.*group_size 1.*every group"),
    (["rollout.workflow=agentic", "rollout.workflow_options={agent: 'a.b:c', group_stats: runs}"],
     r"'rollout\.workflow_options\.group_stats': 'runs' is not one of \['run', 'turn'\]"),
    (["data.apply_chat_template=false", "rollout.workflow=multi_turn"],
     r"rollout\.workflow=multi_turn renders its conversation with the chat template"),
])
def test_bad_values_fail_at_load_naming_the_key(overrides: list[str], message: str) -> None:
    from areal_jax.trainer.run_config import load_run_config

    with pytest.raises(ConfigError, match=message):
        load_run_config(None, overrides)


def test_good_values_of_those_keys_load() -> None:
    from areal_jax.trainer.run_config import load_run_config

    cfg = load_run_config(None, ["rollout.stop_token_ids=[3, 4]", "train.betas=[0.8, 0.99]",
                                 "model.tiny=small", "model.tiny_options.hidden_size=32", "rollout.workflow=multi_turn",
                                 "rollout.workflow_options={max_turns: 3, turn_discount: 1}",
                                 "rollout.filter_uniform_reward=true", "rollout.group_size=2"])
    assert cfg.rollout.stop_token_ids == [3, 4] and cfg.train.betas == (0.8, 0.99)
    assert cfg.rollout.workflow_options == {"max_turns": 3, "turn_discount": 1.0}
    sp = load_run_config(None, ["rollout.ignore_eos=true"]).rollout.sampling_params()
    assert sp["ignore_eos"] is True and "ignore_eos" not in cfg.rollout.sampling_params()
    # tiny_options alone build a tiny model (the size fills in what they leave out)
    assert load_run_config(None, ["model.tiny_options.hidden_size=32"]).model.tiny == "tiny"
    # a user's workflow takes any options: only it knows them
    load_run_config(None, ["rollout.workflow=my_pkg.flows:episode", "rollout.workflow_options.anything=1"])
    load_run_config(None, ["rollout.workflow=agentic", "algo.adv_estimator=reinforce_pp",
                           "rollout.workflow_options={agent: 'a.b:c', trajectory: per_turn}"])
    # per-turn trajectories normalise over a group's runs, so GRPO takes them (refused before)
    load_run_config(None, ["rollout.workflow=agentic", "rollout.workflow_options={agent: 'a.b:c', "
                           "trajectory: per_turn, group_stats: run}"])


def test_micro_batch_tokens_auto_resolves_by_backend() -> None:
    """``train.micro_batch_tokens`` defaults to ``auto``: 1024 on a CPU (where a small model's
    step at 8192 was slower), 8192 on GPU and TPU, made a number only when the trainer starts."""
    from areal_jax.trainer.config import TrainConfig
    from areal_jax.trainer.run_config import load_run_config

    t = load_run_config(None, []).train
    assert t.micro_batch_tokens == "auto"
    assert (t.resolved("cpu").micro_batch_tokens, t.resolved("gpu").micro_batch_tokens,
            t.resolved("tpu").micro_batch_tokens) == (1024, 8192, 8192)
    assert load_run_config(None, ["train.micro_batch_tokens=2048"]).train.resolved("cpu").micro_batch_tokens == 2048
    with pytest.raises(ConfigError, match="train.micro_batch_tokens"):
        load_run_config(None, ["train.micro_batch_tokens=big"])
    with pytest.raises(ValueError, match="micro_batch_tokens must be a positive int or 'auto'"):
        TrainConfig(micro_batch_tokens="big")
    # buckets are checked against the number auto becomes on the backend at hand
    small = TrainConfig(length_buckets=(256, 1024))
    assert small.resolved("cpu").micro_batch_tokens == 1024
    with pytest.raises(ValueError, match="auto is 8192 on gpu: the largest length bucket"):
        small.resolved("gpu")
