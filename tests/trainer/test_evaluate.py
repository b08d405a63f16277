"""``areal-jax eval``: a checkpoint served as the config's rollout says, scored on the held-out
split, one line printed; bad input ends it with one line naming the flag or field."""

import re
from pathlib import Path

import pytest

from areal_jax.cli import main
from areal_jax.models.tiny import make_tiny_checkpoint

DEMO = Path(__file__).parents[2] / "configs" / "demo.yaml"
# The in-process engine (its KV slots split over the tests' 8 devices); every answer scores 1
# (tests/rewards/fns.py), so the printed numbers are known.
QUICK = ["warm_start=null", "data.size=40", "data.eval_size=4", "rollout.backend=local", "rollout.max_new_tokens=4",
         "reward.num_workers=1", "reward.name=tests.rewards.fns:full_marks",
         'rollout.server_args=["--max-running-requests", "8", "--context-length", "64"]']


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("eval") / "ckpt")


def test_eval_scores_a_checkpoint_on_the_held_out_split(checkpoint: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    main(["eval", "--config", str(DEMO), "--model-path", str(checkpoint), *QUICK, f"run_dir={tmp_path}"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(rf"{re.escape(str(checkpoint))}: held-out accuracy 100\.0%, mean reward 1\.000 on 4 prompts",
                        line), line


def test_eval_bad_input_is_one_line(checkpoint: Path, tmp_path: Path) -> None:
    for model, extra, message in ((tmp_path / "nothing", [], r"--model-path \S*nothing: no config.json"),
                                  (checkpoint, ["data.eval_size=0"], "has no held-out split")):
        with pytest.raises(SystemExit) as e:
            main(["eval", "--config", str(DEMO), "--model-path", str(model), *QUICK, f"run_dir={tmp_path}", *extra])
        assert str(e.value.code).startswith("areal-jax eval: ") and re.search(message, str(e.value.code)), e.value.code


@pytest.mark.slow
def test_a_local_run_evaluates_its_warm_start_not_the_base_model(tmp_path: Path) -> None:
    """``rollout.backend=local`` with a warm start serves the warm start from the first request:
    the evaluation before RL scores the warm start's greedy answers (the same as evaluating its
    directory alone), not the base model's. ``steps=0``: the warm start and that evaluation, and
    the run ends there without a step."""
    from areal_jax import train
    from areal_jax.trainer.evaluate import evaluate_checkpoint
    from areal_jax.trainer.model_dirs import base_dir
    from areal_jax.trainer.run_config import load_run_config

    args = [*QUICK[1:], "warm_start.steps=6", "reward.name=tests.rewards.fns:fingerprint", "steps=0",
            "eval.every=0", "export=false", "log.progress=false", f"run_dir={tmp_path}"]
    result = train(str(DEMO), args)
    cfg = load_run_config(DEMO, args)
    warm = evaluate_checkpoint(cfg, tmp_path / "warm_start")["eval_reward"]
    base = evaluate_checkpoint(cfg, base_dir(cfg, tmp_path))["eval_reward"]
    assert result.eval_before["eval_reward"] == warm != base
    assert result.metrics == [] and (tmp_path / "warm_start" / "config.json").exists()
