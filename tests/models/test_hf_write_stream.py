"""Streamed safetensors writing: a stream that announces its layout (``iter_hf_tensors``) is
written header first and tensor by tensor, with the next tensor gathered in a worker thread.
The files must be the same checkpoint the collected path writes, in every dtype and across
shards; a stream that breaks its layout fails naming the tensor and leaves nothing behind; and
after a failure the stream is free to be drained (multi-process gathers must all finish)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.flax

from areal_jax.models import HFTensorStream, iter_hf_tensors, load_pretrained
from areal_jax.models.hf_write import write_hf_dir
from areal_jax.models.tiny import make_tiny_checkpoint


def _read_dir(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a written directory, read by the safetensors library itself."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({k: np.asarray(v) for k, v in safetensors.flax.load_file(str(f)).items()})
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_streamed_checkpoint_equals_the_collected_one(tmp_path: Path, dtype: str) -> None:
    model = load_pretrained(make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny"))
    want = dict(iter_hf_tensors(model, dtype))
    cfg = model.config.to_hf_dict(dtype)
    for shard_bytes in (2 * 1024**3, 48 * 1024):  # one file, and several with an index
        stream = iter_hf_tensors(model, dtype)
        assert [name for name, _, _ in stream.layout] == list(want)
        streamed = write_hf_dir(stream, tmp_path / f"streamed-{shard_bytes}", cfg, max_shard_bytes=shard_bytes)
        collected = write_hf_dir(iter(list(want.items())), tmp_path / f"collected-{shard_bytes}", cfg,
                                 max_shard_bytes=shard_bytes)
        files = sorted(p.name for p in Path(streamed).iterdir())
        assert files == sorted(p.name for p in Path(collected).iterdir())
        assert (len([f for f in files if f.endswith(".safetensors")]) > 1) == (shard_bytes < 1024**2)
        got = _read_dir(Path(streamed))
        assert got.keys() == want.keys()
        for name, arr in want.items():
            assert got[name].dtype == arr.dtype and got[name].shape == arr.shape
            np.testing.assert_array_equal(got[name], arr)
        if shard_bytes < 1024**2:
            index = json.loads((Path(streamed) / "model.safetensors.index.json").read_text())
            assert index == json.loads((Path(collected) / "model.safetensors.index.json").read_text())
        # and it loads as a model again, in the served dtype
        again = dict(iter_hf_tensors(load_pretrained(streamed), dtype))
        for name, arr in want.items():
            np.testing.assert_array_equal(again[name], arr)


def test_a_stream_that_breaks_its_layout_fails_naming_the_tensor(tmp_path: Path) -> None:
    model = load_pretrained(make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny"))
    real = iter_hf_tensors(model)
    items = list(real)
    bad = items[:3] + [(items[3][0], items[3][1][:1])] + items[4:]  # one tensor cut short
    out = tmp_path / "weights" / "v1"
    with pytest.raises(ValueError, match=items[3][0].replace(".", r"\.")):
        write_hf_dir(HFTensorStream(iter(bad), real.layout), out, model.config.to_hf_dict("float32"))
    assert not out.exists() and list(out.parent.iterdir()) == []  # no half-written version, no temp dir
    with pytest.raises(ValueError, match="the end"):
        write_hf_dir(HFTensorStream(iter(items[:-1]), real.layout), out, model.config.to_hf_dict("float32"))
    assert not out.exists()


def test_after_a_failed_write_the_stream_can_be_drained(tmp_path: Path) -> None:
    """The writer's worker thread stops and is joined before the error surfaces, so the caller can
    go on iterating the stream (a multi-process push finishes its collective gathers this way)."""
    model = load_pretrained(make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny"))
    pulled: list[str] = []

    def gather() -> object:
        for i, (name, arr) in enumerate(iter_hf_tensors(model)):
            pulled.append(name)
            if i == 2:
                raise OSError("disk full while gathering")
            yield name, arr

    layout = iter_hf_tensors(model).layout
    stream = HFTensorStream(gather(), layout)
    with pytest.raises(OSError, match="disk full"):
        write_hf_dir(stream, tmp_path / "v1", model.config.to_hf_dict("float32"))
    assert len(pulled) == 3
    assert list(stream) == []  # the generator ended with its error; iterating it again is allowed

    # A failure on the writing side, with tensors still to come: the rest are all still there.
    items = list(iter_hf_tensors(model))
    stream = HFTensorStream(iter(items), [layout[0], (layout[1][0], (1,), layout[1][2]), *layout[2:]])
    with pytest.raises(ValueError, match="expected tensor"):
        write_hf_dir(stream, tmp_path / "v2", model.config.to_hf_dict("float32"))
    left = list(stream)
    assert 0 < len(left) < len(items) and [n for n, _ in left] == [n for n, _ in items[-len(left):]]
