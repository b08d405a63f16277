"""Mesh construction from config and the logical-axis table."""

import jax
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
