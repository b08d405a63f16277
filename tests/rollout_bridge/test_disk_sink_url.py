"""``DiskSink`` with a URL root (fsspec's in-memory filesystem standing in for gs://)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import fsspec
import numpy as np
from safetensors.numpy import load

from areal_jax.models import iter_hf_tensors, load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from rollout_bridge.streamer import DiskSink


def test_disk_sink_writes_versions_to_a_url_and_prunes(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny")
    model = load_pretrained(src)
    url = f"memory://weights-{uuid.uuid4().hex[:8]}/run/"
    sink = DiskSink(url, model.config.to_hf_dict("float32"), tokenizer_dir=src, keep_last=2,
                    max_shard_bytes=64 * 1024)
    metrics = [asyncio.run(sink.push(v, iter_hf_tensors(model, "float32"))) for v in range(3)]
    fs, root = fsspec.core.url_to_fs(url)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == ["v00000001", "v00000002"]
    m = metrics[-1]
    assert m.path == url.rstrip("/") + "/v00000002" and m.tensors > 0
    files = {p.rsplit("/", 1)[-1] for p in fs.find(fsspec.core.url_to_fs(m.path)[1])}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= files
    tensors = {}
    for name in sorted(f for f in files if f.endswith(".safetensors")):
        tensors.update(load(fs.cat_file(f"{fsspec.core.url_to_fs(m.path)[1]}/{name}")))
    expected = dict(iter_hf_tensors(model, "float32"))
    assert tensors.keys() == expected.keys() and m.bytes == sum(a.nbytes for a in expected.values())
    for name, arr in expected.items():
        np.testing.assert_array_equal(tensors[name], arr)


def test_servers_are_told_the_path_they_read_the_bucket_through(tmp_path: Path) -> None:
    """The trainer writes to the bucket's URL; the servers read the bucket through their own mount
    (``rollout.servers_weights_dir``), so the path they are sent is under the mount."""
    src = make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny")
    model = load_pretrained(src)
    told: list[tuple[str, int]] = []

    class Servers:  # records what a fleet would be asked to load
        async def update_weights_from_disk(self, path: str, *, version: int, abort_all_requests: bool) -> list:
            told.append((path, version))
            return [{"success": True}]

    url = f"memory://weights-{uuid.uuid4().hex[:8]}/run"
    sink = DiskSink(url, model.config.to_hf_dict("float32"), client=Servers(), server_root="/mnt/gcs/run/")
    m = asyncio.run(sink.push(7, iter_hf_tensors(model, "float32")))
    assert m.path == f"{url}/v00000007" and told == [("/mnt/gcs/run/v00000007", 7)]
