"""TensorBoard event files for a run's scalars, written directly: the record framing TensorBoard
reads (length, masked CRC-32C of the length, an ``Event`` protobuf, masked CRC-32C of it) and the
few protobuf fields scalars need, encoded here.

Why not tensorboardX: it imports torch where torch is installed (to accept torch tensors; 1-2.3
s of a run's start on a loaded 2-core CPU, and most users who also run SGLang have torch), and
a run logs nothing but floats. The tests read these files with TensorBoard's own protobuf
definitions and check every checksum with an independent CRC-32C.

The messages written (field numbers from TensorBoard's ``event.proto`` and ``summary.proto``):
``Event{wall_time=1 double, step=2 int64, file_version=3 string, summary=5 Summary,
session_log=7 SessionLog}``, ``Summary{value=1 repeated Value}``, ``Value{tag=1 string,
simple_value=2 float}``, ``SessionLog{status=1 enum, START=1}``."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

__all__ = ["EventWriter", "crc32c", "masked_crc32c"]


def _crc_table() -> list[int]:
    poly, table = 0x82F63B78, []  # CRC-32C (Castagnoli), reflected
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C of ``data`` (the checksum TFRecord framing uses)."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked checksum: the CRC rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it (two's complement)
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes or message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(step: int, *, file_version: str | None = None, scalars: Mapping[str, float] | None = None,
           session_start: bool = False) -> bytes:
    out = b"\x09" + struct.pack("<d", time.time()) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars is not None:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    if session_start:
        out += _field(7, b"\x08\x01")
    return out


def _record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


_SERIAL = itertools.count()


class EventWriter:
    """One events file in ``logdir`` (created): ``add_scalars`` writes one ``Event`` of a step's
    scalars. ``purge_step`` (a resumed run's first step): a ``SessionLog.START`` at that step
    first, so TensorBoard hides the events of steps >= it written before (a killed run's steps
    past its checkpoint). ``filename_suffix`` ends the file's name, which TensorBoard needs to
    contain ``tfevents``."""

    def __init__(self, logdir: str | os.PathLike, purge_step: int | None = None, filename_suffix: str = "") -> None:
        directory = Path(logdir)
        directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a folder's files in the order of their names: seconds, then (after
        # the host) microseconds, so a resumed run's file sorts after the run's it follows
        now = time.time_ns() // 1000
        name = (f"events.out.tfevents.{now // 10**6:010d}.{socket.gethostname()}.{now % 10**6:06d}.{os.getpid()}."
                f"{next(_SERIAL):04d}{filename_suffix}")
        self.path = directory / name
        self._file = self.path.open("wb")
        self._file.write(_record(_event(0, file_version="brain.Event:2")))
        if purge_step is not None:
            self._file.write(_record(_event(purge_step, session_start=True)))
        self._file.flush()

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """``scalars`` (tag -> value) at ``step``, as one event."""
        if scalars:
            self._file.write(_record(_event(step, scalars={k: float(v) for k, v in scalars.items()})))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
