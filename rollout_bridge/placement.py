"""Splitting one host's devices between the trainer and its rollout servers, from one config
field (``rollout.server_devices``).

Each rollout server gets an equal, disjoint share of those devices and the trainer keeps the
rest. How a share is enforced depends on the platform:

- ``gpu``: ``CUDA_VISIBLE_DEVICES`` in the server's environment (and in the trainer's, before
  its JAX backend starts, so it never allocates memory on a server's GPU);
- ``tpu``: ``TPU_VISIBLE_CHIPS`` with the process-bounds variables that let several
  independent processes share one TPU host (each its own libtpu, its own port);
- ``cpu``: CPU affinity of the server process (set before it runs any code) and of every
  thread of the trainer's process.

Device ids are as this host names them: GPU ordinals (within ``CUDA_VISIBLE_DEVICES`` if the
trainer was started with it), TPU chip indices, CPU core numbers.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Literal

Platform = Literal["cpu", "gpu", "tpu"]
PLATFORMS: tuple[str, ...] = ("cpu", "gpu", "tpu")

_TPU_CHIP_BOUNDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
"""Chips per process as TPU bounds, for the shares one host can be cut into."""
TPU_BASE_PORT = 8476
"""First libtpu process port; server i uses the next ones (the trainer keeps the base port)."""


@dataclass(frozen=True)
class Placement:
    """Where one process runs: its device ids, the environment that confines it, and (CPU) the
    cores it may run on."""

    devices: tuple[int, ...]
    env: dict[str, str] = field(default_factory=dict)
    cpu_affinity: frozenset[int] | None = None


def detect_platform() -> Platform:
    """The accelerator of this host, without starting a JAX backend (starting one on a GPU
    would already reserve memory on every GPU): ``JAX_PLATFORMS`` if set, else a TPU if its
    device files exist, a GPU if ``nvidia-smi`` is on the path, else the CPU."""
    wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if wanted in ("cuda", "rocm", "gpu"):
        return "gpu"
    if wanted in PLATFORMS:
        return wanted  # type: ignore[return-value]
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    if shutil.which("nvidia-smi"):
        return "gpu"
    return "cpu"


def host_devices(platform: Platform) -> list[int]:
    """Ids of the devices this process may hand out."""
    if platform == "cpu":
        return sorted(os.sched_getaffinity(0))
    if platform == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            return [int(x) for x in visible.split(",") if x.strip()]
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout
        return [int(x) for x in out.split()]
    visible = os.environ.get("TPU_VISIBLE_CHIPS")
    if visible:
        return [int(x) for x in visible.split(",") if x.strip()]
    return list(range(len(glob.glob("/dev/accel[0-9]*")) or len(glob.glob("/dev/vfio/[0-9]*"))))


def split_devices(platform: Platform, server_devices: list[int], num_servers: int,
                  available: list[int] | None = None) -> tuple[Placement, list[Placement]]:
    """``(trainer, [server 0, server 1, ...])``: the servers share ``server_devices`` equally and
    the trainer keeps every other available device. Errors name the field and the fix."""
    if platform not in PLATFORMS:
        raise ValueError(f"rollout.device_platform={platform!r}: choose one of {list(PLATFORMS)} or auto")
    available = host_devices(platform) if available is None else list(available)
    wanted = list(server_devices)
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"rollout.server_devices={wanted} names a device twice")
    unknown = sorted(set(wanted) - set(available))
    if unknown:
        raise ValueError(f"rollout.server_devices: {platform} device(s) {unknown} are not on this host "
                         f"(it has {available}); name some of those")
    if num_servers < 1 or len(wanted) % num_servers:
        raise ValueError(f"rollout.server_devices has {len(wanted)} devices for {num_servers} server(s): give "
                         f"each server the same number (a multiple of rollout.num_servers)")
    trainer = [d for d in available if d not in wanted]
    if not trainer:
        raise ValueError(f"rollout.server_devices={wanted} leaves no {platform} device for the trainer; "
                         f"keep at least one of {available} out of it")
    share = len(wanted) // num_servers
    if platform == "tpu":
        for n in (share, len(trainer)):
            if n not in _TPU_CHIP_BOUNDS:
                raise ValueError(f"rollout.server_devices: a TPU process gets 1, 2, 4 or 8 chips, not {n}; "
                                 f"split the host's {len(available)} chips in such shares")
    servers = [_placement(platform, tuple(wanted[i * share:(i + 1) * share]), port_offset=i + 1)
               for i in range(num_servers)]
    return _placement(platform, tuple(trainer), port_offset=0), servers


def _placement(platform: Platform, devices: tuple[int, ...], port_offset: int) -> Placement:
    ids = ",".join(str(d) for d in devices)
    if platform == "gpu":
        return Placement(devices, {"CUDA_VISIBLE_DEVICES": ids})
    if platform == "tpu":
        port = TPU_BASE_PORT + port_offset
        return Placement(devices, {
            "TPU_VISIBLE_CHIPS": ids, "TPU_CHIPS_PER_PROCESS_BOUNDS": _TPU_CHIP_BOUNDS[len(devices)],
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": f"localhost:{port}", "CLOUD_TPU_TASK_ID": "0",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"})
    return Placement(devices, cpu_affinity=frozenset(devices))


def confine_this_process(placement: Placement) -> None:
    """Keep this (the trainer's) process to its share. CPU: every thread's affinity, now and
    for threads started later. GPU/TPU: the environment its JAX backend reads when it starts;
    if a backend already started without it (a notebook that touched JAX), a ``RuntimeError``
    says to set the variables before Python starts."""
    if placement.cpu_affinity is not None:
        cores = set(placement.cpu_affinity)
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except ProcessLookupError:  # a thread that just ended
                pass
        return
    key = "CUDA_VISIBLE_DEVICES" if "CUDA_VISIBLE_DEVICES" in placement.env else "TPU_VISIBLE_CHIPS"
    if _backend_started() and os.environ.get(key) != placement.env[key]:
        names = " ".join(f"{k}={v}" for k, v in placement.env.items())
        raise RuntimeError(f"rollout.server_devices: this process's JAX backend started before the split and may "
                           f"hold the servers' devices; start Python with {names} (or set them before JAX "
                           f"runs anything)")
    os.environ.update(placement.env)


def _backend_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - jax always has it in the pinned versions
        return False
    return bool(getattr(xla_bridge, "_backends", {}))
