"""The split placement on 8 fake CPU devices: the trainer on some (an fsdp mesh), the engine on
the others (a tensor mesh). The handover moves the params device to device (never through host
memory, checked with JAX's host-to-device transfer guard), for equal and unequal device counts
and for a bfloat16 engine, whose logprobs then stay close to the trainer's; the engine
generates while train steps run; and the demo config runs a few steps in this placement.

The overlap test runs in a subprocess: the engine, the trainer and their timing are easier to
keep apart from other tests there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.inference.types import GenerateRequest, SamplingParams
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.layer_stack import stacked_view
from areal_jax.trainer import TrainConfig, Trainer
from rollout_bridge.local import build_engine, handover, split_devices
from sharding import MeshConfig, make_mesh
from tests import xla_flags
from tests.trainer.helpers import assert_every_version_served

FSDP = MeshConfig(data=1, fsdp=-1, tensor=1)
TENSOR = MeshConfig(data=1, fsdp=1, tensor=-1)
ENGINE_ARGS = ["--max-running-requests", "6", "--context-length", "64"]


def _no_host_transfers() -> contextlib.AbstractContextManager[None]:
    """Raises on any explicit host-to-device transfer in this thread: JAX's slow resharding path
    (``device_put`` reading an array to host and writing it back) is one. Guards are per thread,
    and the device-to-host guard never fires on CPU devices, so this is the one that tells."""
    return jax.transfer_guard_host_to_device("disallow_explicit")


@pytest.mark.parametrize(("engine_devices", "trainer_mesh", "engine_mesh"), [
    # 4 train, 4 generate, and 6 train, 2 generate: resharded on the trainer's devices, then copied
    (4, FSDP, TENSOR),
    (2, MeshConfig(data=3, fsdp=2, tensor=1), TENSOR),
    # 2 train, 6 generate: each trainer shard copied to three engine devices, resharded there
    (6, FSDP, MeshConfig(data=3, fsdp=1, tensor=2)),
])
def test_split_handover_goes_device_to_device(tiny_dir: Path, engine_devices: int, trainer_mesh: MeshConfig,
                                              engine_mesh: MeshConfig) -> None:
    train_devices, gen_devices = split_devices(jax.devices(), engine_devices)
    params = nnx.state(load_pretrained(tiny_dir, mesh=make_mesh(trainer_mesh, train_devices)), nnx.Param)
    engine = build_engine(tiny_dir, ENGINE_ARGS, mesh=make_mesh(engine_mesh, gen_devices), seed=0)
    with _no_host_transfers():
        state, copied = handover(params, engine.state)
    # handed over in the stacked form of the served state (set_state then splits the layers)
    got, old = jax.tree.leaves(state), jax.tree.leaves(stacked_view(engine.state))
    assert copied == sum(x.nbytes for x in jax.tree.leaves(engine.state)) > 0  # other devices: every byte moved
    for x, was, want in zip(got, old, jax.tree.leaves(params), strict=True):
        assert x.sharding == was.sharding and x.dtype == was.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(want))


def test_split_handover_needs_device_counts_that_divide_one_another() -> None:
    with pytest.raises(ValueError, match="divide one another.*among \\[1, 2, 4, 6, 7\\]"):
        split_devices(jax.devices(), 3)  # 5 train, 3 generate


def test_bfloat16_engine_in_the_split_placement_samples_from_the_trainers_weights(tiny_dir: Path) -> None:
    train_devices, gen_devices = split_devices(jax.devices(), 4)
    mesh = make_mesh(FSDP, train_devices)
    trainer = Trainer(load_pretrained(tiny_dir, mesh=mesh), AlgoConfig(),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2), mesh=mesh)
    engine = build_engine(tiny_dir, [*ENGINE_ARGS, "--dtype", "bfloat16"], mesh=make_mesh(TENSOR, gen_devices),
                          seed=0)
    with _no_host_transfers():
        state, copied = handover(trainer.policy.params, engine.state)
    for x, was in zip(jax.tree.leaves(state), jax.tree.leaves(stacked_view(engine.state)), strict=True):
        assert x.dtype == jax.numpy.bfloat16 and x.sharding == was.sharding
    assert copied == sum(x.nbytes for x in jax.tree.leaves(state))
    prompt = [5, 9, 14, 3]

    async def run() -> tuple[list[int], list[float]]:
        await engine.start()
        try:
            await engine.set_state(state, version=1)
            res = await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True)))
            return res.output_ids, res.output_logprobs
        finally:
            await engine.stop()

    ids, logprobs = asyncio.run(run())
    traj = Trajectory.from_prompt_and_answer(np.array(prompt), np.array(ids), np.array(logprobs), 1, reward=0.0,
                                             group_id=0)
    trainer_lp = trainer.compute_logprobs([traj])[0][len(prompt):]
    # bfloat16 keeps 8 significant bits: each weight and activation rounds by up to 0.4%; on this
    # model that moves logprobs by about 2e-3 (float32 engines match to 1e-5, see below).
    np.testing.assert_allclose(logprobs, trainer_lp, atol=2e-2)


SCRIPT = r"""
import asyncio, json, sys, time
import jax, numpy as np
from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.hf_io import load_pretrained
from areal_jax.trainer import TrainConfig, Trainer
from rollout_bridge.local import LocalRolloutClient, build_engine, split_devices
from sharding import MeshConfig, make_mesh
from tests.trainer.helpers import assert_every_version_served
from tests.trainer.helpers import random_trajectories

assert jax.device_count() == 8, jax.devices()
ckpt = sys.argv[1]
train_devices, engine_devices = split_devices(jax.devices(), 4)
train_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), train_devices)
engine_mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), engine_devices)
trainer = Trainer(load_pretrained(ckpt, mesh=train_mesh), AlgoConfig(),
                  TrainConfig(micro_batch_tokens=128, length_buckets=(128,), lr=1e-2))
batch = random_trajectories(np.random.default_rng(0), 16, 4)  # a train step lasts several engine steps
trainer.train_batch(batch, 0)  # compiles, and moves the params away from the checkpoint
engine = build_engine(ckpt, ["--max-running-requests", "4", "--context-length", "64"], mesh=engine_mesh, seed=0)
client = LocalRolloutClient(engine)

TRAIN_STEPS = 12
train_steps = []  # (start, end) of every train step
steps = []  # (start, end) of every engine step, its result on the host
run_step = engine._run_step
def timed(*args, **kwargs):
    t0 = time.perf_counter()
    out = run_step(*args, **kwargs)
    steps.append((t0, time.perf_counter()))
    return out
engine._run_step = timed

async def main():
    async with client:
        m = await client.update_params(trainer.policy.params, version=1)
        placed = {d.id for x in jax.tree.leaves(engine.state) for d in x.sharding.device_set}
        prompt = [5, 9, 14, 3]
        first = await client.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True})
        traj = Trajectory.from_prompt_and_answer(np.array(prompt), np.array(first.output_ids),
                                                 np.array(first.output_logprobs), 1, reward=0.0, group_id=0)
        trainer_lp = trainer.compute_logprobs([traj])[0][len(prompt):]
        sp = {"max_new_tokens": 56, "ignore_eos": True}
        await client.generate(prompt, sp)  # compiles every attended-length bucket
        steps.clear()
        stop = asyncio.Event()

        async def keep_generating(i):  # the engine has work for as long as the trainer trains
            lengths = []
            while not stop.is_set():
                lengths.append(len((await client.generate([7, 8 + i], sp)).output_ids))
            return lengths
        gens = [asyncio.create_task(keep_generating(i)) for i in range(4)]
        while not steps:
            await asyncio.sleep(0.001)
        def train(n):  # train steps back to back; each donates its params: the engine has copies
            for version in range(1, n + 1):
                start = time.perf_counter()
                trainer.train_batch(batch, version)
                train_steps.append((start, time.perf_counter()))
        await asyncio.to_thread(train, TRAIN_STEPS)
        stop.set()
        lengths = [n for out in await asyncio.gather(*gens) for n in out]
        return m, placed, first, trainer_lp, lengths

m, placed, first, trainer_lp, lengths = asyncio.run(main())
print(json.dumps({
    "bytes": m.bytes, "copied": m.copied_bytes, "seconds": m.seconds, "placed": sorted(placed),
    "engine_devices": sorted(d.id for d in engine_devices), "versions": first.output_versions,
    "max_diff": float(np.abs(np.array(first.output_logprobs) - trainer_lp).max()),
    # per train step, the engine steps that ran start to finish inside it
    "inside": [sum(t0 <= a and b <= t1 for a, b in steps) for t0, t1 in train_steps], "lengths": lengths}))
"""


def test_split_placement_hands_over_across_submeshes_and_generates_while_training(tiny_dir: Path) -> None:
    """That engine steps run inside train steps at all is the claim (had the two taken turns,
    none would); how many do is a figure of the machine's load, not asserted."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["placed"] == r["engine_devices"] == [4, 5, 6, 7]  # the engine's params live on its own devices
    assert r["copied"] == r["bytes"] > 0  # other devices: every byte moved
    assert r["versions"] == [1] * 12
    assert r["max_diff"] < 1e-5  # the engine samples from exactly the trainer's weights
    # Engine steps ran start to finish inside train steps (had the two taken turns, none would:
    # train steps run back to back). Not inside every one: other load on a small machine stalls
    # the engine for a train step or more (11 or 12 of 12 alone on 2 cores, 9 beside a second run).
    assert len(r["inside"]) == 12 and sum(n >= 1 for n in r["inside"]) >= 1, r["inside"]
    assert len(r["lengths"]) >= 4 and set(r["lengths"]) == {56}


QUICK = ["warm_start=null", "data.size=300", "data.eval_size=16", "batch_size=2", "rollout.group_size=4",
         "rollout.filter_uniform_reward=false", "rollout.max_new_tokens=4", "log.progress=false",
         "reward.num_workers=1", "export=false", "eval.every=0"]


@pytest.mark.slow
def test_demo_config_runs_with_the_split_placement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rollout.backend=local rollout.local.placement=split`` from the config, end to end: the
    trainer on 4 of the 8 devices, the engine on the other 4, each step's version served."""
    from areal_jax.trainer.rl import train
    from areal_jax.trainer.run_config import load_run_config

    demo = Path(__file__).parents[2] / "configs" / "demo.yaml"
    cfg = load_run_config(demo, [*QUICK, f"run_dir={tmp_path}", "steps=3", "rollout.backend=local",
                                 "rollout.local.placement=split",
                                 "rollout.server_args=[--max-running-requests, '8', --context-length, '64']"])
    train(cfg)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_every_version_served(metrics)
    assert all(m["staleness_max"] <= 2 and m["trajectories"] == 8 for m in metrics)
    assert "rollout: an engine in this process (split placement)" in capsys.readouterr().out
