"""The RL loop end to end on CPU: asynchronous with two embedded servers, synchronous, a custom
workflow and an openai-style agent, each a short real run (servers as child processes, the
reward pool, the trainer, weight pushes)."""

import contextlib
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from areal_jax.trainer.rl import train
from areal_jax.trainer.run_config import load_run_config
from tests.trainer.helpers import NO_EVAL, assert_every_version_served

DEMO = Path(__file__).parents[2] / "configs" / "demo.yaml"
QUICK = ["warm_start=null", "data.size=300", "data.eval_size=16", "batch_size=2", "rollout.group_size=4",
         "rollout.filter_uniform_reward=false",
         "rollout.max_new_tokens=4", "log.progress=false", "reward.num_workers=1"]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def _walk_of_the_tensor_stream() -> Iterator[dict[str, list]]:
    """Profile the run's event-loop thread (the steps, the pushes): every call of a trainer
    function that takes ``iter_hf_tensors`` as an argument (``threaded``), and the file of every
    caller of ``iter_hf_tensors`` (``callers``)."""
    import areal_jax.trainer
    from areal_jax.models import iter_hf_tensors

    room, stream = str(Path(areal_jax.trainer.__file__).parent), iter_hf_tensors.__code__
    walk: dict[str, list] = {"threaded": [], "callers": []}

    def profile(frame, event, arg) -> None:  # noqa: ANN001 - sys.setprofile's signature
        if event != "call":
            return
        code = frame.f_code
        if code is stream:
            walk["callers"].append(Path(frame.f_back.f_code.co_filename).name)
        elif code.co_filename.startswith(room):
            args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
            walk["threaded"] += [(code.co_name, a) for a in args if frame.f_locals.get(a) is iter_hf_tensors]

    sys.setprofile(profile)
    try:
        yield walk
    finally:
        sys.setprofile(None)


@pytest.mark.slow
def test_async_run_two_servers_stays_within_the_staleness_bound(tmp_path: Path) -> None:
    """Also: a walk of the run's event-loop thread finds no step that threads the HF tensor
    stream (``iter_hf_tensors``) through its arguments; only the push module calls it."""
    cfg = load_run_config(DEMO, [*QUICK, f"run_dir={tmp_path}", "steps=6", "rollout.num_servers=2",
                                 "rollout.max_staleness=2", "eval.every=3"])
    with _walk_of_the_tensor_stream() as walk:
        result = train(cfg)
    # The tensor stream has one owner: the push module calls it, no step hands it down.
    assert walk["threaded"] == []
    assert walk["callers"] and set(walk["callers"]) <= {"weight_push.py", "hf_write.py"}, walk["callers"]
    assert "weight_push.py" in walk["callers"]
    metrics = _metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert max(m["staleness_max"] for m in metrics) >= 1  # rollout did run ahead of the trainer
    assert_every_version_served(metrics, servers=2)
    assert metrics[2]["served_versions"] == ["3", "3"]  # an evaluation step waits for its push
    assert metrics[2]["eval_accuracy"] is not None and metrics[5]["eval_accuracy"] is not None
    for key in ("step_seconds", "batch_wait_seconds", "train_seconds", "compile_seconds", "weight_sync_seconds",
                "reward_mean", "staleness_mean", "gen_tokens_per_wall_s", "train_tokens_per_s", "loss", "clip_fraction",
                "behavior_imp_weight_mean", "filtered", "failed", "time", "version"):
        assert key in metrics[0], key
    assert (tmp_path / "final" / "model.safetensors").exists() and (tmp_path / "final" / "tokenizer.json").exists()
    assert result.plot.read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert result.eval_before is not None and 0.0 <= result.eval_after["eval_accuracy"] <= 1.0
    # Step 1 carries the start-up timeline. The evaluation before RL ended before the first
    # batch was asked for; the servers started once the prompts were read (a bad dataset fails
    # before any server: test_bad_data_and_mesh_fail_before_any_model_or_server) and before the
    # tiny base model was written (they import meanwhile, then wait for it; before: once it was
    # written and the prompts tokenised), and said how their start went; the first step's shapes were compiled
    # while its batch was generated, so step 1 compiled nothing itself (before: its gradient and
    # optimizer steps).
    spans = metrics[0]["startup"]
    assert spans["held-out evaluation before RL"][1] <= spans["first batch wait"][0]
    servers = spans["rollout servers started (process, imports, model load, /health)"]
    assert spans["prompts read and checked"][1] <= servers[0] <= spans["base model written"][0]
    assert "server 0: model loaded, engine built" in spans
    assert "first step compiled ahead (background)" in spans and metrics[0]["compile_seconds"] == 0.0
    # the summary names where every output went, the last step's checkpoint included
    assert Path(result.outputs["checkpoints"], "6").is_dir() and Path(result.outputs["final_model"]).is_dir()


@pytest.mark.slow
def test_sync_mode_trains_only_on_current_policy(tmp_path: Path) -> None:
    """Also: weights over disk into a directory outside the run (a shared filesystem's)."""
    shared = tmp_path / "shared" / "weights"
    cfg = load_run_config(DEMO, [*QUICK, *NO_EVAL, f"run_dir={tmp_path / 'run'}", "steps=4", "rollout.mode=sync",
                                 "export=false", "rollout.workflow=multi_turn",
                                 "rollout.workflow_options={max_turns: 2}", "rollout.weight_sync=disk",
                                 f"rollout.weights_dir={shared}"])
    train(cfg)
    metrics = _metrics(tmp_path / "run")
    assert len(metrics) == 4 and all(m["staleness_max"] == 0 for m in metrics)
    assert [m["served_versions"] for m in metrics] == [[str(v)] for v in range(1, 5)]  # the server loaded them
    assert list((shared / "v00000004").glob("*.safetensors"))
    assert not (tmp_path / "run" / "weights").exists()


@pytest.mark.slow
def test_custom_workflow_and_openai_style_agent(tmp_path: Path) -> None:
    train(load_run_config(DEMO, [*QUICK, *NO_EVAL, f"run_dir={tmp_path / 'custom'}", "steps=2", "export=false",
                                 "rollout.workflow=tests.trainer.flows:tagged_episode"]))
    m = _metrics(tmp_path / "custom")
    assert len(m) == 2 and m[0]["reward_mean"] >= 1.0  # the workflow's own reward: answer lengths

    train(load_run_config(DEMO, [*QUICK, *NO_EVAL, f"run_dir={tmp_path / 'agent'}", "steps=2", "export=false",
                                 "rollout.workflow=agentic",
                                 "rollout.workflow_options={agent: 'tests.trainer.flows:calculator_agent'}"]))
    m = _metrics(tmp_path / "agent")
    # each agent run of two completions is one trajectory (concat), so groups stay group_size
    assert len(m) == 2 and all(t == 2 * 4 for t in (x["trajectories"] for x in m))
    assert all(0.0 <= x["reward_mean"] <= 1.0 for x in m)


def test_bad_config_fails_before_anything_starts(tmp_path: Path) -> None:
    from areal_jax.config import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'max_staleness'"):
        load_run_config(DEMO, ["rollout.max_stalenes=3"])
    with pytest.raises(ConfigError, match="rollout.group_size"):
        load_run_config(DEMO, ["rollout.group_size=many"])
    with pytest.raises((ConfigError, ValueError), match="model.attention_impl='flash'"):
        load_run_config(DEMO, ["model.attention_impl=flash"])
    with pytest.raises(ValueError, match="workflow"):
        train(load_run_config(DEMO, [*QUICK, f"run_dir={tmp_path}", "rollout.workflow=nope.nothing:here"]))
    assert not (tmp_path / "logs").exists()  # no server was started


def test_bad_data_and_mesh_fail_before_any_model_or_server(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """An empty or wholly malformed dataset, a held-out split that takes every row, and a mesh the
    devices cannot fill each stop ``areal-jax train`` with one line naming the field and the fix,
    before a server starts (no logs/) and before any model is built (no base/; before, the data
    was read after the base model was written)."""
    from areal_jax.cli import main

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"question": 3}\nnot json\n')
    cases = [
        (["data.source=jsonl", f"data.path={tmp_path / 'empty.jsonl'}"],
         r"data.path=\S*empty.jsonl: no usable rows \(the source is empty\); point data.path at rows"),
        (["data.source=jsonl", "data.format=gsm8k", f"data.path={tmp_path / 'bad.jsonl'}"],
         r"data.path=\S*bad.jsonl: no usable rows \(\{'malformed': 2\}\)"),
        (["data.size=10", "data.eval_size=10"],
         r"data.task='\w+' \(data.size=10\): holding out 10 of 10 rows .* lower data.eval_size"),
        (["mesh.fsdp=3"], r"mesh.data/fsdp/tensor: mesh .* asks for 3 devices, but 8 exist .* set one axis to -1"),
        (["mesh.tensor=3"], r"mesh.data/fsdp/tensor: .* the fixed axes need a multiple of 3 devices, but 8 exist"),
    ]
    for i, (overrides, message) in enumerate(cases):
        run = tmp_path / f"run{i}"
        with pytest.raises(SystemExit) as e:
            main(["train", "--config", str(DEMO), *QUICK, f"run_dir={run}", *overrides])
        assert re.search(message, str(e.value.code)), (overrides, e.value.code)
        assert str(e.value.code).startswith("areal-jax train: ") and "\n" not in str(e.value.code)
        assert not (run / "logs").exists()  # no server was started
        assert not (run / "base").exists()  # no model was built or loaded


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_and_never_pushed(tmp_path: Path) -> None:
    """Every reward NaN: each step's update is skipped on device, counted, and the servers keep
    serving version 0 (nothing pushed); the exported policy is the initial one."""
    from safetensors.numpy import load_file

    train(load_run_config(DEMO, [*QUICK, *NO_EVAL, f"run_dir={tmp_path}", "steps=2",
                                 "rollout.workflow=tests.trainer.flows:nan_reward_episode"]))
    m = _metrics(tmp_path)
    assert [x["skipped_steps"] for x in m] == [1, 1] and m[-1]["skipped_steps_total"] == 2
    # the servers still report the label they started with: no push reached them
    assert [x["version"] for x in m] == [0, 0] and [x["served_versions"] for x in m] == [["default"]] * 2
    assert "grad_norm" not in m[0]  # no finite step to report
    final = load_file(tmp_path / "final" / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert final.keys() == base.keys()
    assert all(np.array_equal(final[k].astype(np.float32), base[k].astype(np.float32)) for k in base)
