"""One host split between the trainer and its rollout servers: the shares each platform gets, the
errors a bad split gives, and on CPU the real thing (a server process and every thread of the
trainer's process confined to their cores)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from areal_jax.models.tiny import make_tiny_checkpoint
from rollout_bridge.launcher import ServerFleet
from rollout_bridge.placement import confine_this_process, split_devices


def test_gpu_servers_get_disjoint_visible_devices_and_the_trainer_the_rest() -> None:
    trainer, servers = split_devices("gpu", [4, 5, 6, 7], 2, available=list(range(8)))
    assert trainer.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [s.env for s in servers] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert trainer.cpu_affinity is None


def test_tpu_shares_get_chips_bounds_and_their_own_ports() -> None:
    trainer, servers = split_devices("tpu", [4, 5, 6, 7], 2, available=list(range(8)))
    assert trainer.env["TPU_VISIBLE_CHIPS"] == "0,1,2,3" and trainer.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "2,2,1"
    assert [s.env["TPU_VISIBLE_CHIPS"] for s in servers] == ["4,5", "6,7"]
    assert {s.env["TPU_CHIPS_PER_PROCESS_BOUNDS"] for s in servers} == {"1,2,1"}
    ports = [p.env["TPU_PROCESS_PORT"] for p in (trainer, *servers)]
    assert len(set(ports)) == 3  # independent libtpu processes on one host
    assert all(p.env["TPU_PROCESS_BOUNDS"] == "1,1,1" for p in (trainer, *servers))


@pytest.mark.parametrize("devices, servers, message", [
    ([1, 1], 1, "names a device twice"),
    ([9], 1, r"device\(s\) \[9\] are not on this host"),
    ([0, 1, 2], 2, "a multiple of rollout.num_servers"),
    ([0, 1, 2, 3], 1, "leaves no gpu device for the trainer"),
])
def test_bad_splits_name_the_field(devices: list[int], servers: int, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        split_devices("gpu", devices, servers, available=[0, 1, 2, 3])
    assert "rollout.server_devices" in str(e.value)


def test_tpu_share_that_is_no_chip_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="1, 2, 4 or 8 chips, not 3"):
        split_devices("tpu", [5, 6, 7], 1, available=list(range(8)))


def test_gpu_split_after_the_backend_started_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import jax

    jax.devices()  # this process's backend is up, as in a notebook that touched JAX
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    trainer, _ = split_devices("gpu", [1], 1, available=[0, 1])
    with pytest.raises(RuntimeError, match="start Python with CUDA_VISIBLE_DEVICES=0"):
        confine_this_process(trainer)
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # nothing half-applied


CONFINE = r"""
import os, sys, threading, time
from rollout_bridge.placement import confine_this_process, split_devices
stop = threading.Event()
before = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in before: t.start()
trainer, _ = split_devices("cpu", [1], 1, available=[0, 1])
confine_this_process(trainer)
after = threading.Thread(target=stop.wait); after.start()
time.sleep(0.1)
cores = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir("/proc/self/task")}
stop.set()
print(len(cores), sorted({tuple(sorted(c)) for c in cores.values()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPU cores 0 and 1")
def test_cpu_split_confines_every_thread_of_the_trainer(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", CONFINE], capture_output=True, text=True, timeout=60, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    threads, affinities = out.stdout.split(maxsplit=1)
    assert int(threads) >= 5 and affinities.strip() == "[(0,)]"  # threads from before and after: core 0 only


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPU cores 0 and 1")
def test_cpu_split_runs_the_embedded_server_on_its_own_core(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "m")
    _, servers = split_devices("cpu", [1], 1, available=[0, 1])
    with ServerFleet(ckpt, 1, tmp_path / "logs", placements=servers, startup_timeout_s=120,
                     extra_args=["--max-running-requests", "2"]) as fleet:
        with urllib.request.urlopen(f"http://{fleet.addresses[0]}/health", timeout=5) as r:
            assert r.status == 200
        pid = fleet.children[0].proc.pid
        tids = os.listdir(f"/proc/{pid}/task")
        assert len(tids) > 2  # XLA's and the server's threads, all of them
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tids} == {frozenset({1})}
