"""Mesh construction from config and the logical-axis table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sharding import DEFAULT_RULES, MeshConfig, logical_to_spec, make_mesh


def test_fixed_and_auto_sizes() -> None:
    assert len(jax.devices()) == 8  # tests/conftest.py
    assert make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)).shape == {"data": 2, "fsdp": 2, "tensor": 2}
    assert make_mesh(MeshConfig(data=1, fsdp=-1, tensor=2)).shape == {"data": 1, "fsdp": 4, "tensor": 2}
    assert make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1)).shape["data"] == 8


def test_mesh_that_does_not_fit_names_sizes() -> None:
    with pytest.raises(ValueError, match=r"asks for 12 devices, but 8 exist"):
        make_mesh(MeshConfig(data=3, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"multiple of 3 devices, but 8 exist"):
        make_mesh(MeshConfig(data=3, fsdp=-1, tensor=1))
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        make_mesh(MeshConfig(data=-1, fsdp=-1))


def test_logical_rules() -> None:
    assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "length", "act_embed")) == P(("data", "fsdp"), None, None)
    # A mesh axis shards at most one dimension of an array.
    assert logical_to_spec(("heads", "mlp")) == P("tensor", None)
    with pytest.raises(KeyError, match="'nonsense' has no rule"):
        logical_to_spec(("nonsense",), DEFAULT_RULES)


def _ids(mesh_devices) -> list:  # noqa: ANN001
    return np.vectorize(lambda d: d.id)(np.asarray(mesh_devices)).tolist()


def test_multi_slice_mesh_puts_each_slice_on_its_own_rows() -> None:
    """CPU devices carry no slice: the fallback cuts them into runs by id. With ``dcn_data=2``
    the data axis's first half is slice 0 (devices 0-3) and its second half slice 1, and the
    per-slice sizes multiply to the mesh's."""
    mesh = make_mesh(MeshConfig(dcn_data=2, data=1, fsdp=2, tensor=2))
    assert mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2} and mesh.axis_names == ("data", "fsdp", "tensor")
    assert _ids(mesh.devices) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    mesh = make_mesh(MeshConfig(dcn_fsdp=2, fsdp=-1, tensor=2))
    assert mesh.shape == {"data": 1, "fsdp": 4, "tensor": 2}
    assert _ids(mesh.devices) == [[[0, 1], [2, 3], [4, 5], [6, 7]]]
    # fsdp across two slices of (data 2, fsdp 2): each slice is one half of the fsdp axis, on
    # both data rows (not the plain reshape's [[0, 1, 2, 3], [4, 5, 6, 7]]).
    mesh = make_mesh(MeshConfig(dcn_fsdp=2, data=2, fsdp=-1, tensor=1))
    assert mesh.shape == {"data": 2, "fsdp": 4, "tensor": 1}
    assert _ids(mesh.devices) == [[[0], [1], [4], [5]], [[2], [3], [6], [7]]]
    # The same mesh runs a batch-sharded reduction (a gradient all-reduce crosses the slices).
    x = jax.device_put(np.arange(16.0).reshape(8, 2), jax.NamedSharding(mesh, P(("data", "fsdp"))))
    assert float(jax.jit(jnp.sum)(x)) == 120.0


class _SliceDevice:
    """A real CPU device seen as part of TPU slice ``slice_index`` (CPU devices have none)."""

    def __init__(self, device, slice_index: int) -> None:  # noqa: ANN001
        self._device, self.slice_index = device, slice_index

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._device, name)


def test_devices_with_slice_index_follow_their_slices_not_their_order() -> None:
    """Devices that carry ``slice_index`` (TPU multi-slice) go through
    ``create_hybrid_device_mesh``: slices interleaved by id (even ids slice 0) still give each
    slice its own half of the data axis."""
    from sharding.mesh import hybrid_device_array, slice_groups

    devices = [_SliceDevice(d, d.id % 2) for d in jax.devices()]
    groups, attr = slice_groups(devices, 2)
    assert attr == "slice_index" and [[d.id for d in g] for g in groups] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    array = hybrid_device_array(MeshConfig(dcn_data=2, data=1, fsdp=-1, tensor=2), devices)
    assert array.shape == (2, 2, 2)
    assert {d.id % 2 for d in array[0].flat} == {0} and {d.id % 2 for d in array[1].flat} == {1}
    # Fewer slices than asked: the fallback by id, not a silent mix of slices.
    assert slice_groups(devices, 4)[1] == "device id"


def test_multi_slice_sizes_that_do_not_fit_say_so() -> None:
    with pytest.raises(ValueError, match=r"3 slices do not divide the 8 devices"):
        make_mesh(MeshConfig(dcn_data=3))
    with pytest.raises(ValueError, match=r"asks for 8 devices, but 4 exist per slice \(2 slices\)"):
        make_mesh(MeshConfig(dcn_data=2, data=2, fsdp=2, tensor=2))
    with pytest.raises(ValueError, match=r"dcn_data \(0\)"):
        make_mesh(MeshConfig(dcn_data=0))
