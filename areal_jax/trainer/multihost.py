"""Multi-host RL runs: process 0 leads, the other processes follow.

In a run over several processes (one per host of a TPU pod slice or GPU cluster) the trainer's
mesh spans every process's devices, so every train step, weight gather, checkpoint save and
export is a collective that all processes enter in the same order. Rollout does not: process 0
alone talks to the rollout servers, runs the controller, the reward pool and evaluation, and
writes the metrics. Before each piece of collective work it ``announce``s it to the others
(``train`` with the batch's trajectories, ``push``, ``save`` with the checkpoint's metadata, and
finally ``stop``, or ``abort`` with the error that ended the run), and each follower ``receive``s
it and does its part. With one process ``announce`` does nothing.

A message is broadcast from process 0 with ``jax.experimental.multihost_utils``: first its length,
then its bytes padded to a power of two (so the broadcast compiles for a handful of sizes only).
Trajectories travel as one binary blob; nothing is pickled.
"""

from __future__ import annotations

import json
import struct
from dataclasses import fields
from typing import Any

import jax
import numpy as np

from areal_jax.data.trajectory import Trajectory

_ARRAYS = (("input_ids", np.int32), ("loss_mask", np.float32), ("behavior_logprobs", np.float32),
           ("versions", np.int32))
_SCALARS = tuple(f.name for f in fields(Trajectory) if f.name not in dict(_ARRAYS))
_MIN_FRAME = 1 << 16


def encode(message: dict[str, Any]) -> bytes:
    """``message`` (JSON values, plus ``trajectories``: a list of ``Trajectory``) as bytes."""
    message = dict(message)
    trajectories = message.pop("trajectories", None)
    blob = b""
    if trajectories is not None:
        message["trajectories"] = [[len(t), *(getattr(t, k) for k in _SCALARS)] for t in trajectories]
        blob = b"".join(np.ascontiguousarray(getattr(t, name), dtype).tobytes()
                        for t in trajectories for name, dtype in _ARRAYS)
    header = json.dumps(message).encode()
    return struct.pack("<Q", len(header)) + header + blob


def decode(data: bytes) -> dict[str, Any]:
    """The message ``encode`` made. Trajectories are rebuilt as they were sent, without checking
    them again: they were checked where they were made, and the followers must train exactly the
    batch process 0 trains (a test may poison one on purpose)."""
    (n,) = struct.unpack_from("<Q", data)
    message = json.loads(data[8:8 + n])
    if "trajectories" in message:
        offset, out = 8 + n, []
        for length, *scalars in message["trajectories"]:
            t = Trajectory.__new__(Trajectory)
            for name, dtype in _ARRAYS:
                size = length * np.dtype(dtype).itemsize
                setattr(t, name, np.frombuffer(data, dtype, length, offset).copy())
                offset += size
            for name, value in zip(_SCALARS, scalars, strict=True):
                setattr(t, name, value)
            out.append(t)
        message["trajectories"] = out
    return message


def _broadcast(data: bytes | None) -> bytes:
    """Process 0's ``data``, on every process (the others pass None)."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    n = int(broadcast_one_to_all(np.array(0 if data is None else len(data), np.int64)))
    frame = np.zeros(max(_MIN_FRAME, 1 << (n - 1).bit_length()), np.uint8)
    if data is not None:
        frame[:n] = np.frombuffer(data, np.uint8)
    return np.asarray(broadcast_one_to_all(frame))[:n].tobytes()


class StepHub:
    """The channel from process 0 (the leader) to the other processes of a run."""

    def __init__(self) -> None:
        self.processes = jax.process_count()
        self.leader = jax.process_index() == 0

    def announce(self, op: str, **payload: Any) -> None:
        """Process 0: tell every other process to do ``op`` (a no-op with one process)."""
        if self.processes > 1:
            _broadcast(encode({"op": op, **payload}))

    def barrier(self, name: str) -> None:
        """Every process waits here until all have arrived (a no-op with one process)."""
        if self.processes > 1:
            from jax.experimental.multihost_utils import sync_global_devices

            sync_global_devices(name)

    def receive(self) -> dict[str, Any]:
        """A follower: the next message of process 0 (blocks until it is sent)."""
        return decode(_broadcast(None))
