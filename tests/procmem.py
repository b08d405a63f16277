"""What a process holds, read from ``/proc`` (Linux): resident memory and memory mappings, for the
tests that bound them and for the suite's own release of compiled programs (``conftest.py``)."""

from __future__ import annotations

from pathlib import Path


def resident_bytes(pid: int | str = "self", field: str = "VmRSS") -> int:
    """Current (``VmRSS``) or peak (``VmHWM``) resident memory of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def resident_mib(pid: int | str = "self") -> float:
    """``resident_bytes`` in MiB."""
    return resident_bytes(pid) / 2**20


def mappings(pid: int | str = "self") -> int:
    """How many memory mappings process ``pid`` holds (the kernel bounds it: vm.max_map_count)."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        return sum(1 for _ in f)
