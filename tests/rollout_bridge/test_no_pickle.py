"""Issue 15: loading checkpoints and weights never unpickles anything. A pickle planted in a
checkpoint directory (``pytorch_model.bin``, ``*.pt``, ``*.pkl``) is ignored next to safetensors
and refused without them, through the loader and through the server's disk weight load alike."""

from __future__ import annotations

import asyncio
import pickle
import re
import shutil
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from areal_jax.models import iter_hf_tensors, load_pretrained
from areal_jax.models.hf_io import CheckpointError
from tests.rollout_bridge.bridge_helpers import running_server

REPO = Path(__file__).resolve().parents[2]
PICKLE_NAMES = ("pytorch_model.bin", "model.pt", "weights.pkl", "training_args.bin", "optimizer.pt")


class _Trap:
    """Unpickling this creates ``path``: proof that something unpickled it."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def _plant(model_dir: Path, marker: Path) -> None:
    for name in PICKLE_NAMES:
        (model_dir / name).write_bytes(pickle.dumps(_Trap(marker)))


def test_pickles_next_to_safetensors_are_never_opened(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "UNPICKLED"
    shutil.copytree(tiny_dir, ckpt)
    _plant(ckpt, marker)
    got = dict(iter_hf_tensors(load_pretrained(ckpt)))
    want = dict(iter_hf_tensors(load_pretrained(tiny_dir)))
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert not marker.exists()


def test_a_checkpoint_of_pickles_only_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ckpt", tmp_path / "UNPICKLED"
    shutil.copytree(tiny_dir, ckpt)
    for f in ckpt.glob("*.safetensors"):
        f.unlink()
    _plant(ckpt, marker)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_pretrained(ckpt)
    # an index that names a pickle is read as safetensors (and fails), never unpickled
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"lm_head.weight": "pytorch_model.bin"}}')
    with pytest.raises(Exception):  # noqa: B017 - any refusal will do, as long as nothing is unpickled
        load_pretrained(ckpt)
    assert not marker.exists()

    async def main() -> None:  # the same directory pushed to a server: refused, old weights serve
        async with running_server(tiny_dir, max_seq_len=64, app_kw={"weight_roots": [tmp_path]}) as (addr, engine), \
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async with s.post(f"http://{addr}/update_weights_from_disk", json={"model_path": str(ckpt)}) as r:
                body = await r.json()
            assert r.status == 400 and not body["success"], body
            assert engine.version == 0

    asyncio.run(main())
    assert not marker.exists()


def test_no_loader_in_the_package_can_unpickle() -> None:
    """The package's sources name no unpickling reader: weights and checkpoints are safetensors."""
    banned = re.compile(r"\b(pickle\.loads?|torch\.load|joblib\.load|dill\.loads?|cloudpickle\.loads?|"
                        r"marshal\.loads?|shelve\.open|allow_pickle\s*=\s*True|trust_remote_code\s*=\s*True|"
                        r"np\.load\(|numpy\.load\()")
    hits = []
    for package in ("areal_jax", "rollout_bridge", "sharding"):
        for f in (REPO / package).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if banned.search(line):
                    hits.append(f"{f.relative_to(REPO)}:{i}: {line.strip()}")
    assert hits == []
