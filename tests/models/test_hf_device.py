"""The weight path's device-side conversions and zero-copy reads, against NumPy and the
safetensors library (every dtype a trainer holds)."""

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load, save_file

from areal_jax.models.hf_device import from_hf, read_safetensors, to_hf
from areal_jax.models.safetensors_codec import encode_tensor_bucket
from rollout_bridge.protocol import decode_tensor_bucket
from sharding import MeshConfig, make_mesh

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_to_hf_slices_transposes_and_casts_like_numpy(dtype) -> None:
    stacked = np.random.default_rng(0).normal(size=(3, 5, 7)).astype(np.float32)
    got = np.asarray(to_hf(jax.device_put(stacked), 1, True, dtype))
    np.testing.assert_array_equal(got, stacked[1].T.astype(dtype))
    assert got.dtype == np.dtype(dtype) and got.flags.c_contiguous
    np.testing.assert_array_equal(np.asarray(to_hf(jax.device_put(stacked[0]), None, False, dtype)),
                                  stacked[0].astype(dtype))


def test_from_hf_builds_the_parameter_on_its_own_sharding() -> None:
    """Whole stacked parameter, some layers of it, and an unstacked one; on a mesh the result has
    the old value's sharding and dtype."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4), jax.devices()[:8])
    sharding = NamedSharding(mesh, PartitionSpec(None, "fsdp", "tensor"))
    rng = np.random.default_rng(1)
    old = jax.device_put(rng.normal(size=(2, 4, 8)).astype(np.float32), sharding)
    hf = [rng.normal(size=(8, 4)).astype(ml_dtypes.bfloat16) for _ in range(2)]  # [out, in] per layer
    new = from_hf(old, hf, [0, 1], transpose=True)
    assert new.sharding == sharding and new.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(new), np.stack([h.T for h in hf]).astype(np.float32))
    one = from_hf(old, hf[1:], [1], transpose=True)  # layer 0 keeps the old value
    np.testing.assert_array_equal(np.asarray(one)[0], np.asarray(old)[0])
    np.testing.assert_array_equal(np.asarray(one)[1], hf[1].T.astype(np.float32))
    flat_old = jax.device_put(np.zeros(8, np.float32))
    np.testing.assert_array_equal(np.asarray(from_hf(flat_old, [np.arange(8, dtype=np.float16)], None, False)),
                                  np.arange(8, dtype=np.float32))


def test_read_safetensors_maps_what_the_library_wrote(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tensors = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float16),
               "c": np.arange(6, dtype=np.int32).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    got = read_safetensors(tmp_path / "x.safetensors")
    assert set(got) == set(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(got[k], v)
        assert isinstance(got[k].base, np.memmap) or isinstance(got[k], np.memmap)  # a view of the mapping
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="offsets"):
        read_safetensors(tmp_path / "cut.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="too short"):
        read_safetensors(tmp_path / "tiny.safetensors")


def test_tensor_buckets_are_safetensors_in_every_dtype() -> None:
    rng = np.random.default_rng(3)
    tensors = {f"t{i}": rng.normal(size=(i + 1, 3)).astype(d) for i, d in enumerate(DTYPES)}
    body = encode_tensor_bucket(tensors)
    n = int.from_bytes(body[:8], "little")
    assert (8 + n) % 8 == 0  # the data starts aligned
    decoded = decode_tensor_bucket(body)
    for k, v in tensors.items():
        assert decoded[k].dtype == v.dtype
        np.testing.assert_array_equal(decoded[k], v)
    plain = {k: v for k, v in tensors.items() if v.dtype != ml_dtypes.bfloat16}
    assert {k: v.tolist() for k, v in load(encode_tensor_bucket(plain)).items()} == \
        {k: v.tolist() for k, v in plain.items()}  # the library reads what we write
