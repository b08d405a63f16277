"""A device mesh from config: axes ``data``, ``fsdp``, ``tensor``; a size of -1 takes the rest."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the three mesh axes. Exactly one may be -1, meaning "all remaining devices"."""

    data: int = 1
    """Pure data parallelism: parameters replicated, batch split."""
    fsdp: int = -1
    """Fully-sharded data parallelism: batch split and parameters sharded along "embed"."""
    tensor: int = 1
    """Tensor (model) parallelism: heads and MLP columns split; keep within one host's chips."""

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        asked = dict(zip(MESH_AXES, sizes, strict=True))
        bad = {k: v for k, v in asked.items() if v == 0 or v < -1}
        if bad:
            raise ValueError(f"mesh sizes must be positive or -1, got {bad}")
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh {asked}: at most one axis may be -1")
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(
                    f"mesh {asked} does not fit: the fixed axes need a multiple of {fixed} devices, "
                    f"but {num_devices} exist"
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh {asked} asks for {math.prod(sizes)} devices, but {num_devices} exist "
                f"({jax.devices()[0].platform}); set one axis to -1 or change the sizes"
            )
        return tuple(sizes)  # type: ignore[return-value]


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a mesh with Auto axis types (explicit axes reject sharded contractions)."""
    cfg = cfg or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    shape = cfg.shape(len(devices))
    if devices == jax.devices():
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
