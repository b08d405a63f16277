"""Mesh construction, logical-axis rules and placement of pytrees on a mesh.

This package knows nothing of models or RL: it maps logical axis names ("embed", "mlp", ...) to
mesh axes ("data", "fsdp", "tensor") through one table, so that changing a run's parallelism is
a config edit.
"""

from sharding.distributed import DistributedConfig, gather_to_host, initialize_distributed, put_from_host
from sharding.mesh import MESH_AXES, MeshConfig, make_mesh
from sharding.rules import (
    DEFAULT_RULES,
    activate,
    constrain,
    logical_axis_size,
    logical_to_sharding,
    logical_to_spec,
    resharded,
    shardings_of,
)

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "DistributedConfig",
    "MeshConfig",
    "activate",
    "constrain",
    "gather_to_host",
    "initialize_distributed",
    "logical_axis_size",
    "logical_to_sharding",
    "logical_to_spec",
    "make_mesh",
    "put_from_host",
    "resharded",
    "shardings_of",
]
