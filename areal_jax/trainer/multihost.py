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
Trajectories travel as binary blobs; nothing is pickled. A follower waits for the next message
on the coordinator's key-value store (process 0 posts a word before each broadcast), not inside
the broadcast: a collective that waits holds the host's devices, so an engine on them
(``rollout.backend: local`` on every host) could not generate while process 0 waits for it.

A ``train`` message does not send every host the whole batch. Given the batch's ``row_owners``
(per process, the trajectories whose packed rows its devices hold, ``BatchPreparer.row_owners``),
the broadcast carries what every process needs of every trajectory (length, scalars, and the loss
mask, one bit a token when it is 0/1), and each follower's own trajectories' tokens, logprobs and
versions (12 bytes a token) go to it alone, through the ``jax.distributed`` coordinator's
key-value store, in pieces of at most 1 MiB. A follower stands a placeholder in for each
trajectory it does not own (NaN logprobs: a placeholder that reached a device would poison the
step, which the two-process tests would see).
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

import jax
import numpy as np

from areal_jax.data.trajectory import Trajectory

_ARRAYS = (("input_ids", np.int32), ("loss_mask", np.float32), ("behavior_logprobs", np.float32),
           ("versions", np.int32))
_SCALARS = tuple(f.name for f in fields(Trajectory) if f.name not in dict(_ARRAYS))
_MIN_FRAME = 1 << 16
_WAIT_MS = 600_000
"""How long a follower waits for its share once the header said it is there (it is, unless
process 0 died in between)."""

log = logging.getLogger(__name__)


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


_TOKENS = tuple(a for a in _ARRAYS if a[0] != "loss_mask")
_PIECE = 1 << 20


def encode_shares(message: dict[str, Any], shares: list[set[int]]) -> tuple[bytes, list[bytes]]:
    """A ``train`` message split by ``shares`` (per process, the trajectory indices it owns):
    the header every process gets, and each process's own token blob."""
    message = dict(message)
    trajectories = message.pop("trajectories")
    masks = [np.asarray(t.loss_mask, np.float32) for t in trajectories]
    flat = np.concatenate(masks) if masks else np.zeros(0, np.float32)
    bits = bool(np.all((flat == 0) | (flat == 1)))
    message["trajectories"] = [[len(t), *(getattr(t, k) for k in _SCALARS)] for t in trajectories]
    message["mask_bits"] = bits
    message["shares"] = [sorted(s) for s in shares]
    header = json.dumps(message).encode()
    mask_blob = np.packbits(flat.astype(bool)).tobytes() if bits else flat.tobytes()
    blobs = [b"".join(np.ascontiguousarray(getattr(trajectories[i], name), dtype).tobytes()
                      for i in sorted(share) for name, dtype in _TOKENS) for share in shares]
    return struct.pack("<Q", len(header)) + header + mask_blob, blobs


def placeholder(length: int, loss_mask: np.ndarray, scalars: Any) -> Trajectory:
    """A trajectory of ``length`` tokens that stands in for one another process owns: its loss
    mask and scalars are real, its tokens 0, its logprobs NaN and its versions 0."""
    t = Trajectory.__new__(Trajectory)
    t.input_ids, t.loss_mask = np.zeros(length, np.int32), loss_mask
    t.behavior_logprobs, t.versions = np.full(length, np.nan, np.float32), np.zeros(length, np.int32)
    for name, value in zip(_SCALARS, scalars, strict=True):
        setattr(t, name, value)
    return t


def local_share(trajectories: list[Trajectory], own: set[int]) -> list[Trajectory]:
    """``trajectories`` as a process that owns only ``own`` of them holds them (``placeholder``
    for the rest)."""
    return [t if i in own else placeholder(len(t), t.loss_mask, [getattr(t, k) for k in _SCALARS])
            for i, t in enumerate(trajectories)]


def decode_share(header: bytes, blob: bytes, process: int) -> dict[str, Any]:
    """The message ``encode_shares`` made, as ``process`` holds it: its own trajectories whole,
    placeholders for the rest."""
    (n,) = struct.unpack_from("<Q", header)
    message = json.loads(header[8:8 + n])
    specs = message.pop("trajectories")
    lengths = [spec[0] for spec in specs]
    total = sum(lengths)
    if message.pop("mask_bits"):
        flat = np.unpackbits(np.frombuffer(header, np.uint8, offset=8 + n), count=total).astype(np.float32)
    else:
        flat = np.frombuffer(header, np.float32, total, 8 + n).copy()
    masks = np.split(flat, np.cumsum(lengths)[:-1]) if lengths else []
    own = set(message["shares"][process])
    out, offset = [], 0
    for i, ((length, *scalars), mask) in enumerate(zip(specs, masks, strict=True)):
        t = placeholder(length, mask, scalars)
        if i in own:
            for name, dtype in _TOKENS:
                setattr(t, name, np.frombuffer(blob, dtype, length, offset).copy())
                offset += length * np.dtype(dtype).itemsize
        out.append(t)
    message["trajectories"] = out
    message["own"] = len(own)
    message["token_bytes"] = len(blob)
    message["header_bytes"] = len(header)
    message["whole_token_bytes"] = total * sum(np.dtype(d).itemsize for _, d in _ARRAYS)
    return message


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


def _store() -> Any:
    """The ``jax.distributed`` coordinator's key-value client. JAX has no public accessor for it
    (orbax and ``multihost_utils`` reach it the same way); if a JAX release moves it, this is the
    one place to change."""
    from jax._src import distributed

    return distributed.global_state.client


def coordinator_host() -> str | None:
    """The host name or IP of the ``jax.distributed`` coordinator (process 0's host), or None."""
    from jax._src import distributed

    address = getattr(distributed.global_state, "coordinator_address", None)
    return address.rsplit(":", 1)[0].strip("[]") if address else None


class StepHub:
    """The channel from process 0 (the leader) to the other processes of a run."""

    def __init__(self, row_owners: Callable[[list[Trajectory]], list[set[int]]] | None = None) -> None:
        self.processes = jax.process_count()
        self.leader = jax.process_index() == 0
        self.row_owners = row_owners
        """The trainer's ``BatchPreparer.row_owners``: set, a ``train`` message sends each
        follower its own share of the batch only; None, the whole batch."""
        self._sent = 0
        self._messages = 0
        """Messages announced (process 0) or received (a follower) so far."""

    def announce(self, op: str, **payload: Any) -> None:
        """Process 0: tell every other process to do ``op`` (a no-op with one process)."""
        if self.processes <= 1:
            return
        shares = None
        if op == "train" and self.row_owners is not None:
            try:
                shares = self.row_owners(payload["trajectories"])
            except Exception:  # a batch the plan refuses goes whole: every process meets the same error
                shares = None
        if shares is None:
            with self._next():
                _broadcast(b"W" + encode({"op": op, **payload}))
            return
        self._sent += 1
        header, blobs = encode_shares({"op": op, "seq": self._sent, **payload}, shares)
        store = _store()
        for p in range(1, self.processes):  # in the store before the header says to look
            pieces = [blobs[p][i:i + _PIECE] for i in range(0, len(blobs[p]), _PIECE)] or [b""]
            for k, piece in enumerate(pieces):
                store.key_value_set_bytes(f"areal_jax/train/{self._sent}/{p}/{k}", piece)
            store.key_value_set(f"areal_jax/train/{self._sent}/{p}/n", str(len(pieces)))
        with self._next():
            _broadcast(b"S" + header)  # the first byte says whole (W) or split (S)

    # A follower spends most of a run waiting for process 0's next message. It waits on the
    # key-value store, not inside the broadcast: a collective that waits holds this host's
    # devices, and an engine on them (``backend: local``) could not generate meanwhile, while
    # process 0 waits for its answers before it announces anything.

    @contextlib.contextmanager
    def _next(self) -> Iterator[None]:
        """Process 0, around a broadcast: say that the next message comes, and once the broadcast
        is through (every follower entered it, so read the word) take the word back."""
        store = _store()
        self._messages += 1
        key = f"areal_jax/next/{self._messages}"
        store.key_value_set(key, "1")
        try:
            yield
        finally:
            store.key_value_delete(key)

    def _wait_next(self) -> None:
        """A follower: wait, off the devices, until process 0 is about to broadcast the next message."""
        self._messages += 1
        while True:
            try:
                _store().blocking_key_value_get(f"areal_jax/next/{self._messages}", _WAIT_MS)
                return
            except Exception as e:  # a long step on process 0: wait on; anything else is raised
                if "deadline" not in str(e).lower():
                    raise

    def post(self, key: str, value: str) -> None:
        """A follower: put ``value`` under ``key`` for process 0 (``collect``), through the
        coordinator's key-value store; an engine's address, the outcome of staging a push."""
        _store().key_value_set(f"areal_jax/{key}/{jax.process_index()}", value)

    def collect(self, key: str, timeout_s: float) -> list[str]:
        """Process 0: what every follower ``post``ed under ``key``, in process order (waiting at
        most ``timeout_s`` for each); taken out of the store, so the key can be used again."""
        store, out = _store(), []
        for p in range(1, self.processes):
            name = f"areal_jax/{key}/{p}"
            try:
                out.append(store.blocking_key_value_get(name, max(int(timeout_s * 1000), 1)))
            except Exception as e:  # the store's deadline error names no key: say which wait ran out
                raise TimeoutError(f"process {p} did not post {key!r} within {timeout_s:g}s "
                                   f"({type(e).__name__}: {e})") from None
            store.key_value_delete(name)
        return out

    def barrier(self, name: str) -> None:
        """Every process waits here until all have arrived (a no-op with one process)."""
        if self.processes > 1:
            from jax.experimental.multihost_utils import sync_global_devices

            sync_global_devices(name)

    def receive(self) -> dict[str, Any]:
        """A follower: the next message of process 0 (blocks until it is sent). A ``train`` message
        holds this process's own trajectories whole and placeholders for the rest, with ``own``
        (how many are its own), ``token_bytes`` (what it received of their per-token arrays),
        ``whole_token_bytes`` (what the whole batch's are) and ``header_bytes`` (the broadcast
        part: lengths, loss masks, scalars)."""
        self._wait_next()
        data = _broadcast(None)
        if data[:1] == b"W":
            return decode(data[1:])
        header, me = data[1:], jax.process_index()
        (n,) = struct.unpack_from("<Q", header)
        seq = json.loads(header[8:8 + n])["seq"]
        store, prefix = _store(), f"areal_jax/train/{seq}/{me}"
        count = int(store.blocking_key_value_get(f"{prefix}/n", _WAIT_MS))
        blob = b"".join(store.blocking_key_value_get_bytes(f"{prefix}/{k}", _WAIT_MS) for k in range(count))
        store.key_value_delete(f"{prefix}/n")
        for k in range(count):
            store.key_value_delete(f"{prefix}/{k}")
        message = decode_share(header, blob, me)
        log.info("process %d: step %s: %d of %d trajectories its own, %d of %d token bytes received "
                 "(and %d bytes of lengths, loss masks and scalars)", me, message.get("step"), message["own"],
                 len(message["trajectories"]), message["token_bytes"], message["whole_token_bytes"],
                 message["header_bytes"])
        return message
