"""The split placement on 8 fake CPU devices: the trainer on 4 (fsdp mesh), the engine on the other
4 (tensor mesh). The handover reshards the params device to device, the engine then matches the
trainer's forward, and it generates while train steps run (its steps' timestamps fall inside
the training's).

Runs in a subprocess because the device count is fixed when JAX starts, and this pytest process
may already have started it with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import asyncio, json, sys, time
import jax, numpy as np
from areal_jax.algo import AlgoConfig
from areal_jax.data.trajectory import Trajectory
from areal_jax.models.hf_io import load_pretrained
from areal_jax.trainer import TrainConfig, Trainer
from rollout_bridge.local import LocalRolloutClient, build_engine, split_devices
from sharding import MeshConfig, make_mesh
from tests.trainer.helpers import random_trajectories

assert jax.device_count() == 8, jax.devices()
ckpt = sys.argv[1]
train_devices, engine_devices = split_devices(jax.devices(), 4)
train_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), train_devices)
engine_mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), engine_devices)
trainer = Trainer(load_pretrained(ckpt, mesh=train_mesh), AlgoConfig(),
                  TrainConfig(micro_batch_tokens=128, length_buckets=(128,), lr=1e-2))
batch = random_trajectories(np.random.default_rng(0), 8, 4)
trainer.train_batch(batch, 0)  # compiles, and moves the params away from the checkpoint
engine = build_engine(ckpt, ["--max-running-requests", "4", "--context-length", "64"], mesh=engine_mesh, seed=0)
client = LocalRolloutClient(engine)

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
        m = await client.update_params(trainer.params, version=1)
        placed = {d.id for x in jax.tree.leaves(engine.state) for d in x.sharding.device_set}
        prompt = [5, 9, 14, 3]
        first = await client.generate(prompt, {"max_new_tokens": 12, "ignore_eos": True})
        traj = Trajectory.from_prompt_and_answer(np.array(prompt), np.array(first.output_ids),
                                                 np.array(first.output_logprobs), 1, reward=0.0, group_id=0)
        trainer_lp = trainer.compute_logprobs([traj])[0][len(prompt):]
        sp = {"max_new_tokens": 56, "ignore_eos": True}
        await client.generate(prompt, sp)  # compiles every attended-length bucket
        steps.clear()
        gens = [asyncio.create_task(client.generate([7, 8 + i], sp)) for i in range(4)]
        while not steps:
            await asyncio.sleep(0.001)
        def train_for(seconds):  # train steps back to back for a while, long enough to hold engine steps
            start = time.perf_counter()
            version = 1
            while version == 1 or time.perf_counter() - start < seconds:
                trainer.train_batch(batch, version)  # donates its params: the engine has copies
                version += 1
        t0 = time.perf_counter()
        await asyncio.to_thread(train_for, 1.0)
        t1 = time.perf_counter()
        outs = await asyncio.gather(*gens)
        return m, placed, first, trainer_lp, (t0, t1), outs

m, placed, first, trainer_lp, (t0, t1), outs = asyncio.run(main())
print(json.dumps({
    "bytes": m.bytes, "copied": m.copied_bytes, "seconds": m.seconds, "placed": sorted(placed),
    "engine_devices": sorted(d.id for d in engine_devices), "versions": first.output_versions,
    "max_diff": float(np.abs(np.array(first.output_logprobs) - trainer_lp).max()),
    "train": [t0, t1], "inside": sum(t0 <= a and b <= t1 for a, b in steps),
    "lengths": [len(o.output_ids) for o in outs]}))
"""


@pytest.mark.serial
def test_split_placement_hands_over_across_submeshes_and_generates_while_training(tiny_dir: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_dir)], env=env, capture_output=True, text=True,
                          timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["placed"] == r["engine_devices"] == [4, 5, 6, 7]  # the engine's params live on its own devices
    assert r["copied"] == r["bytes"] > 0  # other devices: every byte moved
    assert r["versions"] == [1] * 12
    assert r["max_diff"] < 1e-5  # the engine samples from exactly the trainer's weights
    assert r["inside"] >= 1, r  # engine steps ran start to finish while training ran
    assert r["lengths"] == [56] * 4
