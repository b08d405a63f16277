"""The in-process rollout client: donation-safe handover of the trainer's params to an engine in
the same process (the engine serving the trainer's very buffers where layouts match, and
resharding and casting on device where they do not), answers resumed across a handover with
per-token versions, the engine's logprobs equal to the trainer's forward after a handover, the
HTTP client's control calls, and the demo learning in process, its warm start scoring alike over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.hf_io import load_pretrained
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.run_config import load_run_config
from rollout_bridge.client import GenerateResult, RolloutError
from rollout_bridge.local import LocalRolloutClient, build_engine, handover, split_devices
from sharding import MeshConfig, make_mesh
from tests.trainer.helpers import assert_every_version_served, random_trajectories, tiny_model

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
TRAIN = TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2)


def _values(tree: object) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]  # raises on a deleted (donated) array


def _buffers(tree: object) -> dict[str, tuple[int, ...]]:
    """Where each leaf's shards live in device memory, by path: equal only for the same buffers."""
    return {jax.tree_util.keystr(path): tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
            for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_trainer_never_deletes_the_given_model_nor_lent_params() -> None:
    model = tiny_model()  # an engine may be serving this very model
    before = _values(model)
    trainer = Trainer(model, AlgoConfig(), TRAIN)
    trajs = random_trajectories(np.random.default_rng(0), 2, 4)
    lent = trainer.policy.lend()
    trainer.train_batch(trajs, 0)
    for a, b in zip(_values(model), before, strict=True):  # the given model: readable, unchanged
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_values(lent), before, strict=True):  # the lent params outlive the update too
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(_values(trainer.policy.params), before, strict=True))
    unlent = jax.tree.leaves(trainer.policy.params)
    trainer.train_batch(trajs, 1)  # not lent: donated as before, so an update holds one copy
    assert all(x.is_deleted() for x in unlent)


# --- the client over an engine in this process (shared placement, one device) --------------------

ENGINE_ARGS = ["--max-running-requests", "4", "--context-length", "64"]


@pytest.fixture(scope="module")
def shared(tiny_dir: Path) -> tuple[Trainer, LocalRolloutClient]:
    """A trainer one step past the checkpoint, and a client over an engine still serving it."""
    trainer = Trainer(load_pretrained(tiny_dir), AlgoConfig(), TRAIN)
    trainer.train_batch(random_trajectories(np.random.default_rng(2), 2, 4), 0)
    # the trainer's layout, so the engine can serve the lent arrays themselves (the default split
    # layout copies the layer parameters: test_layer_stack)
    return trainer, LocalRolloutClient(build_engine(tiny_dir, [*ENGINE_ARGS, "--layer-layout", "stacked"], seed=0))


def test_handover_shares_the_arrays_and_the_engine_matches_the_trainers_forward(
        shared: tuple[Trainer, LocalRolloutClient]) -> None:
    trainer, client = shared
    prompt = [5, 9, 14, 3]
    sp = {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 7}

    async def run() -> tuple[Any, ...]:
        async with client:
            lent = trainer.policy.lend()
            olds = jax.tree.leaves(client.engine.state)
            metrics = await client.update_params(lent, version=1)
            buffers = _buffers(client.engine.state), _buffers(lent)
            # ... under the engine's own sharding objects, which its compiled steps were built for
            assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(client.engine.state), olds,
                                                                strict=True))
            first = await client.generate(prompt, sp)
            traj = Trajectory.from_prompt_and_answer(np.array(prompt), np.array(first.output_ids),
                                                     np.array(first.output_logprobs), 1, reward=0.0, group_id=0)
            trainer_lp = trainer.compute_logprobs([traj])[0][len(prompt):]
            # The next update must neither delete nor change what the engine serves now.
            await asyncio.to_thread(trainer.train_batch, random_trajectories(np.random.default_rng(3), 2, 4), 1)
            again = await client.generate(prompt, sp)
            return metrics, buffers, first, trainer_lp, again

    metrics, (served, lent), first, trainer_lp, again = asyncio.run(run())
    assert metrics.copied_bytes == 0 and metrics.bytes > 0  # same dtype and layout: no copy ...
    assert served == lent and len(served) == metrics.tensors  # ... the engine serves the lent buffers themselves
    assert first.output_versions == [1] * 12 and client.server_versions() == {"local": 1}
    np.testing.assert_allclose(first.output_logprobs, trainer_lp, atol=1e-5)
    assert again.output_ids == first.output_ids and again.output_logprobs == first.output_logprobs


def test_shared_placement_on_a_mesh_serves_the_trainers_buffers(tiny_dir: Path) -> None:
    """On 8 devices (fsdp) the engine takes the trainer's mesh and layouts: nothing is copied."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), jax.devices())
    params = nnx.state(load_pretrained(tiny_dir, mesh=mesh), nnx.Param)
    engine = build_engine(tiny_dir, ["--max-running-requests", "8", "--context-length", "64"], mesh=mesh, seed=0)
    state, copied = handover(params, engine.state)
    assert copied == 0 and _buffers(state) == _buffers(params)
    assert all(len(x.addressable_shards) == 8 for x in jax.tree.leaves(state))


@pytest.mark.parametrize("order", [1, -1])  # the engine's mesh over the same devices, or in reverse
@pytest.mark.parametrize("spec", [P("x"), P(None, "x"), P()])
def test_shared_handover_changes_layout_and_dtype_on_device(order: int, spec: P) -> None:
    """On the trainer's own devices, a param whose layout or dtype differs is resharded and cast
    in place, never read back to host (``jax.device_put`` to a replicated layout would be)."""
    devices = np.array(jax.devices())
    x = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8), NamedSharding(Mesh(devices, ("x",)), P("x")))
    like = jax.device_put(np.zeros((8, 8), jnp.bfloat16), NamedSharding(Mesh(devices[::order], ("x",)), spec))
    with jax.transfer_guard_host_to_device("disallow_explicit"):  # per thread; see test_local_split.py
        state, copied = handover({"w": x}, {"w": like})
    assert state["w"].sharding == like.sharding and state["w"].dtype == jnp.bfloat16 and copied == like.nbytes
    np.testing.assert_array_equal(np.asarray(state["w"], np.float32), np.asarray(x))


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_handover_during_generation_resumes_answers_with_per_token_versions(
        shared: tuple[Trainer, LocalRolloutClient], mode: str) -> None:
    trainer, client = shared
    engine = client.engine
    budget = 40

    async def run() -> list[GenerateResult]:
        async with client:
            await client.update_params(trainer.policy.lend(), version=1)
            # The same three requests once, short, so no compilation falls between their starts
            # below (on a cold cache one answer could run to its end while another compiled).
            await asyncio.gather(*(client.generate([7, 8, 9 + i], {"max_new_tokens": 4, "ignore_eos": True})
                                   for i in range(3)))
            tasks = [asyncio.create_task(client.generate([7, 8, 9 + i], {"max_new_tokens": budget, "ignore_eos": True}))
                     for i in range(3)]
            # Every answer has started (a token of version 1 each; counting tokens in all let one
            # request that was still queued through), none is done. An answer that finished first
            # would leave fewer than three live forever: fail at once instead of waiting for it.
            started: set[str] = set()
            deadline = asyncio.get_running_loop().time() + 60.0
            while len(started) < 3:
                started |= {rid for rid, seq in engine._live.items() if seq.out_ids}
                if any(t.done() for t in tasks) or asyncio.get_running_loop().time() > deadline:
                    pytest.fail(f"the handover must come mid-answer: {len(started)} of 3 answers started, "
                                f"{sum(t.done() for t in tasks)} already done")
                await asyncio.sleep(0.002)
            await client.pause(mode)
            await client.update_params(trainer.policy.lend(), version=2)
            await client.continue_generation()
            return await asyncio.gather(*tasks)

    for r in asyncio.run(run()):
        assert len(r.output_ids) == len(r.output_logprobs) == len(r.output_versions) == budget
        assert r.finish_reason == {"type": "length", "length": budget}
        k = r.output_versions.count(1)
        assert 0 < k < budget and r.output_versions == [1] * k + [2] * (budget - k)
        assert r.resends == (1 if mode == "abort" else 0)  # retract: the engine re-queues the request itself


def test_the_http_clients_control_calls_work_in_process(shared: tuple[Trainer, LocalRolloutClient],
                                                        tiny_dir: Path) -> None:
    """What a caller written for ``HttpRolloutClient`` calls: health, abort, flush, the in-place
    pause, relabelling, and weights from host tensors and from disk (with its HTTP arguments)."""
    trainer, client = shared
    engine = client.engine
    sp = {"max_new_tokens": 40, "ignore_eos": True}

    async def started(task: asyncio.Task) -> None:
        start = engine.stats["generated_tokens"]
        while engine.stats["generated_tokens"] - start < 4 and not task.done():
            await asyncio.sleep(0)  # each turn of the loop: a warm engine decodes 40 tokens within 5 ms

    async def run() -> dict[str, Any]:
        out: dict[str, Any] = {"health": [await client.check_health()]}
        async with client:
            out["health"].append(await client.check_health())
            await client.update_params(trainer.policy.lend(), version=1)
            task = asyncio.create_task(client.generate([7, 8, 9], sp, rid="gone"))
            await started(task)
            # Held in its slot, so it cannot run to its end before the calls below (a warm engine
            # decodes 40 tokens in a few milliseconds).
            await client.pause("in_place")
            with pytest.raises(RolloutError, match="running"):
                await client.flush_cache()  # refused while a request runs
            await client.abort("gone")
            await client.continue_generation()
            out["aborted"] = await task
            await client.flush_cache()  # idle: done

            task = asyncio.create_task(client.generate([7, 8, 10], sp))
            await started(task)
            await client.pause("in_place")
            paused_at = engine.stats["generated_tokens"]
            await asyncio.sleep(0.05)
            out["paused_steps"] = engine.stats["generated_tokens"] - paused_at
            out["relabel"] = await client.update_weight_version(2)
            out["versions"] = client.server_versions(), await client.reported_versions()
            await client.continue_generation()
            out["in_place"] = await task

            norm = {"model.norm.weight": np.full(64, 2.0, np.float32)}
            out["tensors"] = await client.update_weights_from_tensors(norm, version=3)
            out["norm_set"] = _has_leaf(engine.state, norm["model.norm.weight"])
            out["disk"] = await client.update_weights_from_disk(str(tiny_dir), version=4, flush_cache=False)
            out["norm_after_disk"] = _has_leaf(engine.state, norm["model.norm.weight"])
            out["final_versions"] = client.server_versions(), await client.reported_versions()
        out["health"].append(await client.check_health())
        return out

    out = asyncio.run(run())
    assert out["health"] == [[False], [True], [False]]  # before start, running, after close
    aborted = out["aborted"]
    assert aborted.finish_reason["type"] == "abort" and 0 < len(aborted.output_ids) < 40 and aborted.resends == 0
    assert out["paused_steps"] == 0
    assert out["relabel"][0]["reply"]["new_version"] == "2" and out["versions"] == ({"local": 2}, {"local": "2"})
    in_place = out["in_place"]  # kept its slot and KV: not re-sent; tokens after the relabel carry 2
    k = in_place.output_versions.count(1)
    assert in_place.resends == 0 and 0 < k < 40 and in_place.output_versions == [1] * k + [2] * (40 - k)
    assert out["tensors"][0]["reply"]["weight_version"] == "3" and out["norm_set"]
    assert out["disk"][0]["reply"]["weight_version"] == "4" and not out["norm_after_disk"]
    assert out["final_versions"] == ({"local": 4}, {"local": "4"})


def _has_leaf(state: Any, value: np.ndarray) -> bool:
    return any(x.shape == value.shape and np.array_equal(np.asarray(x), value) for x in jax.tree.leaves(state))


def test_requests_are_checked_as_over_http(shared: tuple[Trainer, LocalRolloutClient]) -> None:
    _, client = shared

    async def run(sp: dict[str, Any]) -> Any:
        async with client:
            return await client.generate([1, 2, 3], sp)

    for bad, field in (({"top_p": 0.0}, "top_p"), ({"max_new_tokens": 100}, "context length"), ({"nope": 1}, "nope")):
        with pytest.raises(RolloutError, match=field):
            asyncio.run(run(bad))
    assert asyncio.run(run({"max_new_tokens": 0})).output_ids == []


def test_config_chooses_the_local_backend_and_its_placement() -> None:
    cfg = load_run_config(DEMO, ["rollout.backend=local", "rollout.local.placement=split",
                                 "rollout.local.engine_devices=4", "rollout.local.engine_mesh={tensor: 2, data: 2}"])
    local = cfg.rollout.local
    assert cfg.rollout.backend == "local" and local.placement == "split" and local.engine_devices == 4
    assert local.engine_mesh.shape(4) == (2, 1, 2)
    with pytest.raises(ValueError, match="shared placement"):
        split_devices(jax.devices()[:1], None)
    with pytest.raises(ValueError, match="placement"):
        load_run_config(DEMO, ["rollout.local.placement=elsewhere"])


def _user_env() -> dict[str, str]:
    """The environment a user starts ``areal-jax`` in on a one-device machine: not the suite's
    fake devices, nor its servers' compile threads (0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "AREAL_JAX_COMPILE_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


DEMO_WARM_START = ROOT / "tests" / "fixtures" / "demo_warm_start"
"""The demo's warm start as ``configs/demo.yaml`` trained it at de185ed. It does not follow later changes
of the demo's model or warm start: its README gives the command that makes it again."""


def test_the_demo_warm_start_fixture_is_the_demo_configs_model(tmp_path: Path) -> None:
    """``DEMO_WARM_START`` has the shapes, dtype and tokenizer of the model ``configs/demo.yaml``
    builds today: a change to the demo's model fails here, naming the fixture's README, rather
    than leaving the demo test to run another model than the demo's."""
    from areal_jax.trainer.model_dirs import prepare_model_dir
    from areal_jax.trainer.run_config import load_run_config

    base = prepare_model_dir(load_run_config(DEMO, ["seed=0"]), tmp_path)  # the demo's base model, as its run makes it
    want, got = (json.loads((d / "config.json").read_text()) for d in (base, DEMO_WARM_START))
    hint = f"configs/demo.yaml's model changed: make {DEMO_WARM_START} again ({DEMO_WARM_START / 'README.md'})"
    assert {k: v for k, v in got.items() if k != "transformers_version"} == {
        k: v for k, v in want.items() if k != "transformers_version"}, hint
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (DEMO_WARM_START / name).read_text() == (base / name).read_text(), f"{name}: {hint}"


def _demo(run_dir: Path, *overrides: str) -> tuple[float, list[dict[str, Any]]]:
    """Held-out accuracy before RL and the metrics of a 10-step demo run from the demo's warm
    start (``DEMO_WARM_START``), as a user starts it on a one-device machine (a subprocess: this
    one has 8 fake devices)."""
    cmd = [sys.executable, "-m", "areal_jax.cli", "train", "--config", str(DEMO), f"run_dir={run_dir}", "seed=0",
           "warm_start=null", "model.tiny=null", "model.tiny_options={}", f"model.path={DEMO_WARM_START}",
           "steps=10", "eval.every=10", "log.progress=false", "export=false", *overrides]
    proc = subprocess.run(cmd, env=_user_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = float(re.search(r"accuracy before RL: ([\d.]+)%", proc.stdout + proc.stderr).group(1)) / 100
    return before, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_demo_learns_with_the_local_backend_as_over_http(tmp_path: Path) -> None:
    """The demo's RL (10 steps of asynchronous GRPO from its warm start) with
    ``rollout.backend=local``: the warm start scores the same served over HTTP (``areal-jax eval``,
    an embedded server) as in process, every step served the version just trained, rollout ran
    ahead within the staleness bound, and the answers did not fall apart (held-out accuracy at step
    10 above half the warm start's).

    The warm start is the committed ``DEMO_WARM_START``, not trained here: its 190 supervised
    steps were about a third of this test's time on a cold compile cache and exercise nothing of
    the backend. Runs that train a warm start before RL: tests/test_examples.py,
    tests/trainer/test_run_dir.py, tests/trainer/test_multihost_run.py; the local engine serving
    the warm start rather than the base model: tests/trainer/test_evaluate.py.

    Accuracy at the end is not compared with a run over HTTP: a few asynchronous steps from the
    demo's warm start are a coin toss (20-step runs from an earlier warm start at 66%, on another
    CPU, ended at 50.5-80.5% on either backend). A backend whose engine served
    wrong or stale weights is caught token by token by tests/rollout_bridge/test_version_invariant.py,
    on every backend; the floor here catches an engine whose weights were broken in the handover
    (a random model scores near 0%). The asynchronous loop over HTTP is run end to end by
    tests/trainer/test_rl_loop.py."""
    run_dir = tmp_path / "local"
    before, metrics = _demo(run_dir, "rollout.backend=local")
    assert before > 0.3, before  # the fixture is a trained model of the task (50.5% when committed)
    # The server compiles each shape as the requests meet it (compile threads 0): the score is
    # the same, and compiling every other shape in the background cost 8-11 more CPU-s of the
    # evaluation (alternating, warm cache, 2026-11-29)
    proc = subprocess.run([sys.executable, "-m", "areal_jax.cli", "eval", "--config", str(DEMO), "--model-path",
                           str(DEMO_WARM_START), f"run_dir={tmp_path / 'eval'}", "seed=0"],
                          env={**_user_env(), "AREAL_JAX_COMPILE_THREADS": "0"}, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    over_http = float(re.search(r"held-out accuracy ([\d.]+)%", proc.stdout).group(1)) / 100
    assert over_http == before  # the same warm start, served alike
    assert_every_version_served(metrics)
    assert all(m["staleness_max"] <= 2 for m in metrics)
    assert max(m["staleness_max"] for m in metrics) >= 1  # rollout ran ahead of the trainer
    assert metrics[-1]["eval_accuracy"] > before / 2, (before, metrics[-1]["eval_accuracy"])
