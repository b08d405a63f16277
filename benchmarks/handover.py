"""Weight handover to an in-process engine on 8 fake CPU devices, split 4 + 4: the trainer's
float32 params (fsdp mesh on devices 0-3) handed to an engine on devices 4-7 (tensor mesh), in
float32 and cast to bfloat16, beside a plain device-to-device copy of the same bytes (one flat
array sharded over devices 0-3, put on 4-7 with the same layout), the param tree put on 4-7 with
the trainer's layout (per-tensor cost without resharding), and the shared placement's handover
(engine on the trainer's devices: no copy). Random weights; best of ``--repeats``.

    python benchmarks/handover.py [--out results.json] [--sizes 3M,25M,100M] [--repeats 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_jax.inference.engine import Engine, EngineConfig  # noqa: E402
from areal_jax.models import Decoder, ModelConfig  # noqa: E402
from rollout_bridge.local import LocalRolloutClient, split_devices  # noqa: E402
from sharding import MeshConfig, make_mesh, shardings_of  # noqa: E402

SIZES = {  # name -> (hidden, intermediate, layers, heads, kv_heads, vocab), as in weight_update.py
    "3M": (256, 512, 4, 8, 2, 2048),
    "25M": (512, 1536, 6, 8, 2, 8192),
    "100M": (768, 2304, 12, 12, 4, 16384),
}


def model_config(name: str, dtype: str) -> ModelConfig:
    h, i, n, nh, kvh, v = SIZES[name]
    return ModelConfig(model_type="qwen2", vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                       num_attention_heads=nh, num_key_value_heads=kvh, head_dim=h // nh, tie_word_embeddings=True,
                       max_position_embeddings=512, param_dtype=dtype, dtype=dtype)


def on_mesh(name: str, dtype: str, mesh: jax.sharding.Mesh) -> Decoder:
    """A random model whose params are sharded on ``mesh`` by the project's rules."""
    model = Decoder(model_config(name, dtype), rngs=nnx.Rngs(0))
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, shardings_of(state, mesh)))
    return model


def best(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


async def handover_seconds(params: nnx.State, engine: Engine, repeats: int) -> tuple[float, int, int]:
    """Best ``update_params`` time, bytes served and bytes copied."""
    times = []
    async with LocalRolloutClient(engine) as client:
        for version in range(1, repeats + 1):
            m = await client.update_params(params, version=version)
            times.append(m.seconds)
    return min(times), m.bytes, m.copied_bytes


async def bench_size(name: str, repeats: int) -> dict:
    train_devices, engine_devices = split_devices(jax.devices(), 4)
    train_mesh = make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), train_devices)
    engine_mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=-1), engine_devices)
    params = nnx.state(on_mesh(name, "float32", train_mesh))
    engine_cfg = EngineConfig(num_slots=4, max_seq_len=64)  # the shared engine splits slots over fsdp=4
    row: dict = {"model": name, "params": model_config(name, "float32").num_params()}

    f32 = Engine(on_mesh(name, "float32", engine_mesh), engine_cfg, eos_token_ids=[], mesh=engine_mesh)
    row["split_f32_s"], row["bytes_f32"], copied = await handover_seconds(params, f32, repeats)
    assert copied == row["bytes_f32"]
    del f32
    bf16 = Engine(on_mesh(name, "bfloat16", engine_mesh), engine_cfg, eos_token_ids=[], mesh=engine_mesh)
    row["split_bf16_s"], row["bytes_bf16"], _ = await handover_seconds(params, bf16, repeats)
    del bf16

    # The same bytes as one flat float32 array, moved device to device with an unchanged layout.
    n = row["bytes_f32"] // 4
    n -= n % 4
    src = jax.device_put(jnp.ones((n,), jnp.float32), NamedSharding(train_mesh, PartitionSpec("fsdp")))
    dst = NamedSharding(make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), engine_devices), PartitionSpec("fsdp"))
    row["plain_copy_s"] = best(lambda: jax.block_until_ready(jax.device_put(src, dst)), repeats)
    # The param tree itself moved to devices 4-7 with the trainer's layout: per-tensor cost, no resharding.
    same_layout = shardings_of(params, make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1), engine_devices))
    row["tree_copy_s"] = best(lambda: jax.block_until_ready(jax.device_put(params, same_layout)), repeats)

    # Shared placement: the engine on the trainer's devices and mesh, float32: nothing moves.
    shared = Engine(on_mesh(name, "float32", train_mesh), engine_cfg, eos_token_ids=[], mesh=train_mesh)
    row["shared_s"], _, row["shared_copied"] = await handover_seconds(params, shared, repeats)
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--sizes", default="3M,25M,100M")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if jax.device_count() != 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()}; unset XLA_FLAGS or give it "
                         "--xla_force_host_platform_device_count=8")
    rows = []
    for name in args.sizes.split(","):
        r = await bench_size(name, args.repeats)
        rows.append(r)
        print(f"{r['model']:>5} {r['params'] / 1e6:6.1f}M params {r['bytes_f32'] / 2**20:6.1f} MiB | split 4+4 "
              f"f32 {r['split_f32_s'] * 1e3:7.1f} ms  bf16 {r['split_bf16_s'] * 1e3:7.1f} ms | plain copy "
              f"{r['plain_copy_s'] * 1e3:7.1f} ms  tree {r['tree_copy_s'] * 1e3:7.1f} ms | "
              f"shared {r['shared_s'] * 1e3:5.1f} ms "
              f"({r['shared_copied']} bytes copied)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
