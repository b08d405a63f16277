"""Tensor-parallel serving: on 8 fake CPU devices, a tensor=2 mesh with fused projections (as the
server loads them) gives the single-device output of separate ones.

Runs in a subprocess because the device count is fixed when JAX starts, and this pytest process
may already have started it with one device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import xla_flags

SCRIPT = r"""
import asyncio, json, sys
import jax
from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.models.hf_io import load_pretrained
from sharding import MeshConfig, make_mesh

assert jax.device_count() == 8, jax.devices()
ckpt = sys.argv[1]
prompts = [[5, 9, 14], [30, 31, 32, 33, 34, 35, 36], [77] * 12, [100, 4]]
cfg = EngineConfig(num_slots=4, max_seq_len=32, max_prefill_batch=4, decode_steps=4)
sp = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)

async def generate(engine):
    await engine.start()
    try:
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, sp)) for p in prompts))
    finally:
        await engine.stop()
    return [o.output_ids for o in outs], [o.output_logprobs for o in outs]

single = asyncio.run(generate(Engine(load_pretrained(ckpt), cfg)))
mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2))
model = load_pretrained(ckpt, mesh=mesh, fuse_projections=True)
engine = Engine(model, cfg, mesh=mesh)
sharded = asyncio.run(generate(engine))
specs = {str(engine._lanes[0].cache.k.sharding.spec), str(model.layers.mlp.gate_up_proj.kernel[...].sharding.spec)}
print(json.dumps({"single": single, "sharded": sharded, "specs": sorted(specs)}))
"""


def test_tensor_parallel_greedy_matches_single_device(ckpt: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, XLA_FLAGS=xla_flags.devices(8), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sharded"][0] == result["single"][0]
    for a, b in zip(result["sharded"][1], result["single"][1], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    assert any("tensor" in s for s in result["specs"]), result["specs"]
