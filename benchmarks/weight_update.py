"""Weight-update time on the disk and HTTP-bucket paths, beside the raw safetensors write + read
of the same bytes, for a few model sizes (random weights).

The server is an embedded server process on 127.0.0.1 (``areal-jax serve``, started as a run
starts its fleet), so its reading, conversion and swap run beside the trainer's side, as in a
deployment. A push is timed from the trainer's params on its device to the server's answer that
it serves the new version (``TransferMetrics.seconds``); the bound is ``safetensors`` writing the
same tensors to a file plus reading them back, measured right after each push (the same memory
and page-cache state, as the machine drifts). Each figure is the median over ``--repeats``
pushes, and each ratio the median of the pushes' ratios to their own bound; the first push of
each path (which compiles the conversions) is left out.
The HTTP path is timed as a run takes it (kernels in our own layout, transposed on neither side)
and, as ``http_hf``, with the buckets in HF layout (both sides transpose every matrix).

    python benchmarks/weight_update.py [--out results.json] [--sizes 3M,25M,100M] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_jax.models import Decoder, ModelConfig, iter_hf_tensors, save_pretrained  # noqa: E402
from areal_jax.models.tiny import build_char_tokenizer  # noqa: E402
from rollout_bridge.client import ClientConfig, HttpRolloutClient  # noqa: E402
from rollout_bridge.launcher import ServerFleet  # noqa: E402
from rollout_bridge.streamer import DiskSink, HttpBucketSink  # noqa: E402

SIZES = {  # name -> (hidden, intermediate, layers, heads, kv_heads, vocab)
    "3M": (256, 512, 4, 8, 2, 2048),
    "25M": (512, 1536, 6, 8, 2, 8192),
    "100M": (768, 2304, 12, 12, 4, 16384),
}


def make_model(name: str) -> Decoder:
    h, i, n, nh, kvh, v = SIZES[name]
    cfg = ModelConfig(model_type="qwen2", vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=n,
                      num_attention_heads=nh, num_key_value_heads=kvh, head_dim=h // nh, tie_word_embeddings=True,
                      max_position_embeddings=512)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def raw_write_read(tensors: dict[str, np.ndarray], path: Path) -> tuple[float, float]:
    """Seconds to write ``tensors`` to ``path`` through ``safetensors`` itself, and to read them back."""
    t0 = time.perf_counter()
    save_file(tensors, str(path))
    t1 = time.perf_counter()
    loaded = load_file(str(path))
    t2 = time.perf_counter()
    assert len(loaded) == len(tensors)
    del loaded
    path.unlink()
    return t1 - t0, t2 - t1


async def bench_size(name: str, workdir: Path, repeats: int) -> dict:
    model = make_model(name)
    src = workdir / f"src-{name}"
    save_pretrained(model, src)
    build_char_tokenizer().save_pretrained(str(src))  # the server wants one; the weights are what is timed
    fleet = ServerFleet(src, 1, workdir / f"logs-{name}", weight_roots=[workdir],
                        extra_args=["--max-running-requests", "2", "--context-length", "64"])
    row: dict = {"model": name, "params": model.config.num_params()}
    tensors = dict(iter_hf_tensors(model, "float32"))  # the raw bound's bytes, on the host
    raw: list[tuple[float, float]] = []  # (write, read) seconds, one pair right after each timed push
    try:
        addresses = await asyncio.to_thread(fleet.start)
        async with HttpRolloutClient(addresses, config=ClientConfig(weight_timeout_s=600)) as client:
            disk = DiskSink(workdir / f"w-{name}", model.config.to_hf_dict("float32"), client=client, keep_last=1)
            http = HttpBucketSink(client, bucket_bytes=64 * 1024**2)
            version = 0
            # http: what a run does between our trainer and our servers (kernels in our layout, no
            # transposes); http_hf: the same buckets in HF layout, as the disk path must write them
            for label, sink, hf_layout in (("disk", disk, True), ("http", http, False), ("http_hf", http, True)):
                times, ratios = [], []
                for _ in range(repeats + 1):
                    version += 1
                    m = await sink.push(version, iter_hf_tensors(model, "float32", hf_layout=hf_layout))
                    assert client.server_versions() == {f"http://{addresses[0]}": version}
                    times.append(m.seconds)
                    row["bytes"] = m.bytes
                    row[f"{label}_buckets"] = m.buckets
                    if len(times) > 1:  # the first push compiles the conversions
                        raw.append(raw_write_read(tensors, workdir / "raw.safetensors"))
                        ratios.append(m.seconds / sum(raw[-1]))
                row[f"{label}_first_s"], row[f"{label}_all_s"] = times[0], times[1:]
                row[f"{label}_s"] = statistics.median(times[1:])
                row[f"{label}_over_bound"] = statistics.median(ratios)
    finally:
        fleet.stop()
    row["raw_write_s"] = statistics.median(w for w, _ in raw)
    row["raw_read_s"] = statistics.median(r for _, r in raw)
    row["raw_write_read_all_s"] = [w + r for w, r in raw]
    return row


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--sizes", default="3M,25M,100M")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="weight-bench-"))
    rows = []
    try:
        for name in args.sizes.split(","):
            rows.append(await bench_size(name, workdir, args.repeats))
            r = rows[-1]
            print(f"{r['model']:>5} {r['params'] / 1e6:7.1f}M params {r['bytes'] / 2**20:7.1f} MiB | "
                  f"disk {r['disk_s']:6.2f}s ({r['disk_over_bound']:.1f}x)  http {r['http_s']:6.2f}s "
                  f"({r['http_over_bound']:.1f}x, {r['http_buckets']} buckets; HF layout {r['http_hf_s']:.2f}s, "
                  f"{r['http_hf_over_bound']:.1f}x) | "
                  f"raw write {r['raw_write_s']:5.2f}s read {r['raw_read_s']:5.2f}s", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
