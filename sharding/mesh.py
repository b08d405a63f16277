"""A device mesh from config: axes ``data``, ``fsdp``, ``tensor``; a size of -1 takes the rest.

Multi-slice (several TPU slices joined over the data-centre network, DCN, or several GPU hosts
whose links between hosts are slower than those inside one): ``dcn_data`` and ``dcn_fsdp`` split
the ``data`` and ``fsdp`` axes across slices, so that only their gradient reductions (and FSDP's
gathers, with ``dcn_fsdp``) cross the slow network, while ``tensor`` and the rest of ``fsdp``
stay on each slice's own interconnect (ICI). The mesh still has the three axes; the sizes in
config are per slice and the mesh's are the products (``data * dcn_data`` ...). The slices are
the devices' ``slice_index`` (TPU multi-slice; ``jax.experimental.mesh_utils.
create_hybrid_device_mesh`` lays each one out), else their processes (one per GPU host), else, where
devices carry neither (one CPU process in tests), consecutive runs of devices by id.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the three mesh axes within one slice (exactly one may be -1, meaning "all
    remaining devices of the slice"), and how many slices the data and fsdp axes span."""

    data: int = 1
    """Pure data parallelism: parameters replicated, batch split."""
    fsdp: int = -1
    """Fully-sharded data parallelism: batch split and parameters sharded along "embed"."""
    tensor: int = 1
    """Tensor (model) parallelism: heads and MLP columns split; keep within one host's chips."""
    dcn_data: int = 1
    """Slices the ``data`` axis spans (multi-slice: data parallelism across slices, which only
    all-reduce gradients over the slow network). 1: a single slice."""
    dcn_fsdp: int = 1
    """Slices the ``fsdp`` axis spans (parameter gathers cross the slow network: prefer
    ``dcn_data``). 1: a single slice."""

    @property
    def slices(self) -> int:
        return self.dcn_data * self.dcn_fsdp

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """The mesh's axis sizes over ``num_devices`` devices (all slices together)."""
        if self.dcn_data < 1 or self.dcn_fsdp < 1:
            raise ValueError(f"mesh.dcn_data ({self.dcn_data}) and mesh.dcn_fsdp ({self.dcn_fsdp}) must be >= 1")
        if num_devices % self.slices:
            raise ValueError(f"mesh.dcn_data * mesh.dcn_fsdp = {self.slices} slices do not divide the "
                             f"{num_devices} devices evenly")
        d, f, t = self.slice_shape(num_devices // self.slices)
        return d * self.dcn_data, f * self.dcn_fsdp, t

    def slice_shape(self, num_devices: int) -> tuple[int, int, int]:
        """The axis sizes within one slice of ``num_devices`` devices."""
        sizes = [self.data, self.fsdp, self.tensor]
        asked = dict(zip(MESH_AXES, sizes, strict=True))
        bad = {k: v for k, v in asked.items() if v == 0 or v < -1}
        if bad:
            raise ValueError(f"mesh sizes must be positive or -1, got {bad}")
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh {asked}: at most one axis may be -1")
        where = f" per slice ({self.slices} slices)" if self.slices > 1 else ""
        fixed = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % fixed:
                raise ValueError(
                    f"mesh {asked} does not fit: the fixed axes need a multiple of {fixed} devices, "
                    f"but {num_devices} exist{where}"
                )
            sizes[sizes.index(-1)] = num_devices // fixed
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh {asked} asks for {math.prod(sizes)} devices, but {num_devices} exist{where} "
                f"({jax.devices()[0].platform}); set one axis to -1 or change the sizes"
            )
        return tuple(sizes)  # type: ignore[return-value]


def slice_groups(devices: Sequence[jax.Device], slices: int) -> tuple[list[list[jax.Device]], str]:
    """``devices`` cut into ``slices`` groups, in order, and what the cut followed: ``slice_index``
    (TPU multi-slice), ``process_index`` (one process per host), or ``device id`` (devices that
    carry neither, or fewer distinct ones than ``slices``: consecutive runs by id)."""
    for attr in ("slice_index", "process_index"):
        groups: dict[int, list[jax.Device]] = defaultdict(list)
        for d in devices:
            groups[getattr(d, attr, None)].append(d)
        if None not in groups and len(groups) == slices:
            return [groups[k] for k in sorted(groups)], attr
    ordered = sorted(devices, key=lambda d: d.id)
    n = len(ordered) // slices
    return [ordered[i * n:(i + 1) * n] for i in range(slices)], "device id"


def hybrid_device_array(cfg: MeshConfig, devices: Sequence[jax.Device]) -> np.ndarray:
    """The devices of a multi-slice mesh as an array of the mesh's shape: within a slice laid out
    as ``jax.experimental.mesh_utils`` would (physical topology on TPU), and along ``data`` and
    ``fsdp`` the slices one after another (index ``slice * per_slice + i``)."""
    from jax.experimental import mesh_utils

    groups, attr = slice_groups(devices, cfg.slices)
    ici = cfg.slice_shape(len(devices) // cfg.slices)
    dcn = (cfg.dcn_data, cfg.dcn_fsdp, 1)
    if attr == "slice_index":
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices))
    if attr == "process_index":
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, list(devices), process_is_granule=True)
    per_slice = [np.asarray(g, dtype=object).reshape(ici) for g in groups]
    blocks = np.empty(dcn, dtype=object)
    for i, block in enumerate(per_slice):
        blocks[np.unravel_index(i, dcn)] = block
    return np.block(blocks.tolist())


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a mesh with Auto axis types (explicit axes reject sharded contractions)."""
    cfg = cfg or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    shape = cfg.shape(len(devices))
    axis_types = (AxisType.Auto,) * 3
    if cfg.slices > 1:
        return Mesh(hybrid_device_array(cfg, devices), MESH_AXES, axis_types=axis_types)
    if devices == jax.devices():
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)
