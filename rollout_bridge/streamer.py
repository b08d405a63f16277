"""The weight streamer: trainer params -> HF-named tensors -> inference servers.

``iter_hf_tensors`` gathers one (possibly sharded) parameter at a time and casts it to the
serving dtype; ``buckets`` groups the stream into size-bounded buckets; a ``WeightSink`` delivers
one version and reports a ``TransferMetrics``. Sinks:

* ``DiskSink``: a versioned HF checkpoint (safetensors + config.json + tokenizer files), written
  to a temp dir and renamed into place, then ``/update_weights_from_disk`` on every server. Works
  with real SGLang servers and with ours over a shared filesystem; keeps the last K versions.
  The root may also be a URL (``gs://bucket/run/weights``, any fsspec scheme), for servers that
  read that store or mount it.
* ``HttpBucketSink``: each bucket POSTed as safetensors bytes to our embedded servers'
  ``/update_weights_from_tensor``; the servers apply the whole version atomically at the end.
  Between our own trainer and servers the kernels travel in our layout (``native_layout``), so
  neither side transposes a matrix; the other sinks take HF tensors only.
* ``LocalSink``: an engine in this process (``LocalRolloutClient``); ``push_params`` hands it
  the trainer's params on device (no HF names, no host memory), ``push`` takes host tensors.

An NCCL sink for GPU SGLang servers fits the same interface: ``push`` would call
``/init_weights_update_group`` once, then per bucket ``/update_weights_from_distributed`` with
names, dtypes and shapes while broadcasting the tensors from trainer rank 0.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from areal_jax.models.hf_io import HFTensorStream
from areal_jax.models.hf_write import is_url, size_groups, write_hf_dir
from areal_jax.models.safetensors_codec import layout_nbytes, tensor_bucket_parts
from rollout_bridge.records import WeightUpdateError

Tensors = Iterable[tuple[str, np.ndarray]]
Bucket = list[tuple[str, np.ndarray]]


@dataclass
class TransferMetrics:
    """What one weight push cost."""

    version: int
    bytes: int
    """Tensor payload bytes (the serving dtype), not counting file or HTTP overhead."""
    seconds: float
    """Wall time from the first tensor gathered to the last server acknowledging."""
    buckets: int
    tensors: int
    servers: int = 0
    path: str | None = None
    """Checkpoint directory, for the disk path."""


def buckets(tensors: Tensors, bucket_bytes: int) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Group tensors into lists of at most ``bucket_bytes``; a bigger tensor travels alone."""
    return size_groups(tensors, bucket_bytes, lambda t: t[1].nbytes)


class WeightSink(abc.ABC):
    """Delivers one policy version's weights to the inference side."""

    native_layout: bool = False
    """Whether this sink takes kernels in our own layout (``iter_hf_tensors(hf_layout=False)``):
    only the HTTP buckets to our own servers do; disk checkpoints and SGLang stay HF."""

    can_hold: bool = False
    """Whether ``push(hold=True)`` and ``commit`` work: the servers take a version while they
    generate and serve it at ``commit`` (only our own servers, over HTTP buckets)."""

    @abc.abstractmethod
    async def push(self, version: int, tensors: Tensors) -> TransferMetrics:
        """Deliver ``tensors`` (HF names) as ``version``; returns once every server serves it."""

    async def commit(self, version: int, *, pause_mode: str | None = None) -> None:
        """Serve ``version``, pushed with ``hold`` (inside a pause of ``pause_mode``, if given);
        sinks that cannot hold never get here."""
        raise NotImplementedError(f"{type(self).__name__} does not hold pushed weights")


class DiskSink(WeightSink):
    """A versioned HF checkpoint on (shared) disk, then ``/update_weights_from_disk`` everywhere."""

    def __init__(self, root: str | os.PathLike, hf_config: dict[str, Any], *, client: Any = None,
                 tokenizer_dir: str | os.PathLike | None = None, keep_last: int = 2,
                 max_shard_bytes: int = 2 * 1024**3, abort_all_requests: bool = False,
                 server_root: str | None = None):
        """``root`` is a local directory or a URL (``gs://...``; see ``hf_write.is_url``).
        ``hf_config`` is the config.json content (``ModelConfig.to_hf_dict(dtype)``); ``client`` a
        ``RolloutClient`` (None: only write). ``keep_last`` versions stay on disk, older ones go.
        ``server_root``: the same directory as the servers name it (a mount of the bucket the
        trainer writes to, say); None: ``root``."""
        self.root: Path | str = os.fspath(root).rstrip("/") if is_url(root) else Path(root)
        self.server_root = None if server_root is None else server_root.rstrip("/")
        self.hf_config = hf_config
        self.client = client
        self.tokenizer_dir: Path | str | None = None
        if tokenizer_dir:
            self.tokenizer_dir = os.fspath(tokenizer_dir) if is_url(tokenizer_dir) else Path(tokenizer_dir)
        self.keep_last = keep_last
        self.max_shard_bytes = max_shard_bytes
        self.abort_all_requests = abort_all_requests

    def version_dir(self, version: int) -> Path | str:
        name = f"v{version:08d}"
        return f"{self.root}/{name}" if isinstance(self.root, str) else self.root / name

    def write(self, version: int, tensors: Tensors) -> tuple[Path | str, int, int]:
        """Write the checkpoint atomically; returns (dir, bytes, tensors). Blocking."""
        _require_hf_layout(tensors, "DiskSink")
        count = {"bytes": 0, "n": 0}

        def counted() -> Iterator[tuple[str, np.ndarray]]:
            for name, arr in tensors:
                count["bytes"] += arr.nbytes
                count["n"] += 1
                yield name, arr

        layout = getattr(tensors, "layout", None)  # kept: the writer streams into a file laid out first
        stream = counted() if layout is None else HFTensorStream(counted(), layout)
        out = write_hf_dir(stream, self.version_dir(version), self.hf_config, tokenizer_dir=self.tokenizer_dir,
                           max_shard_bytes=self.max_shard_bytes)
        return out, count["bytes"], count["n"]

    def prune(self) -> None:
        """Delete all but the newest ``keep_last`` version directories."""
        if isinstance(self.root, str):
            import fsspec

            fs, root = fsspec.core.url_to_fs(self.root)
            names = sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(root, detail=False))
            versions = [n for n in names if n.startswith("v") and n[1:].isdigit()]
            for name in versions[: max(0, len(versions) - self.keep_last)]:
                fs.rm(f"{root.rstrip('/')}/{name}", recursive=True)
            return
        versions = sorted(p for p in self.root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
        for p in versions[: max(0, len(versions) - self.keep_last)]:
            shutil.rmtree(p, ignore_errors=True)

    async def push(self, version: int, tensors: Tensors) -> TransferMetrics:
        t0 = time.perf_counter()
        path, nbytes, n = await asyncio.to_thread(self.write, version, tensors)
        servers = 0
        if self.client is not None:
            seen = str(path) if self.server_root is None else f"{self.server_root}/{Path(str(path)).name}"
            replies = await self.client.update_weights_from_disk(
                seen, version=version, abort_all_requests=self.abort_all_requests)
            servers = len(replies)
        await asyncio.to_thread(self.prune)
        return TransferMetrics(version=version, bytes=nbytes, seconds=time.perf_counter() - t0,
                               buckets=1, tensors=n, servers=servers, path=str(path))


class HttpBucketSink(WeightSink):
    """Safetensors buckets POSTed to every embedded server's ``/update_weights_from_tensor``.

    Tensors are gathered in a worker thread, one bucket ahead of the one on the wire, so host
    memory holds about two buckets, never the whole model; a bucket goes out as its header and
    views of its tensors' bytes, never copied into one body first. When the tensors say their
    ``layout`` up front (``iter_hf_tensors`` does), the buckets are planned from it and the next
    one is gathered while this one is sent (and the servers convert the one before); otherwise
    the next bucket is gathered first, to learn whether this one is the last.
    """

    can_hold = True

    def __init__(self, client: Any, *, bucket_bytes: int = 256 * 1024**2, flush_cache: bool = True,
                 native_layout: bool = True):
        """``native_layout``: ask the trainer for kernels in our own layout (see ``WeightSink``);
        a stream says which it is (``HFTensorStream.hf_layout``) and the buckets say it on."""
        self.client = client
        self.bucket_bytes = bucket_bytes
        self.flush_cache = flush_cache
        self.native_layout = native_layout
        self._held: tuple[int, str, dict[str, str]] | None = None

    async def push(self, version: int, tensors: Tensors, *, hold: bool = False) -> TransferMetrics:
        """``hold``: the servers build the version while they keep generating and serve it only
        at ``commit(version)``, so a pause need only cover the swap."""
        t0 = time.perf_counter()
        transfer_id = uuid.uuid4().hex
        nbytes = n = sent = servers = 0
        failed: dict[str, str] = {}
        layout = "hf" if getattr(tensors, "hf_layout", True) else "native"
        async with contextlib.aclosing(_planned_buckets(tensors, self.bucket_bytes)) as planned:
            async for cur, last in planned:
                try:
                    replies = await self.client.push_tensor_bucket(
                        tensor_bucket_parts(cur), version=version, transfer_id=transfer_id, bucket=sent,
                        last=last, flush_cache=self.flush_cache, skip=failed, layout=layout, hold=hold)
                except WeightUpdateError as e:
                    # A server that refused a bucket gets no more of this transfer (it keeps its old
                    # weights and drops the part it staged); the others still get the whole version.
                    failed.update(e.failed)
                    if not any(s.healthy and s.url not in failed for s in self.client.servers):
                        raise
                    replies = []
                servers = len(replies)
                nbytes += sum(a.nbytes for _, a in cur)
                n += len(cur)
                sent += 1
        self._held = (version, transfer_id, failed) if hold else None
        if failed:
            raise WeightUpdateError(f"/update_weights_from_tensor of version {version} failed on "
                                    + "; ".join(f"{url} {why}" for url, why in failed.items()), failed)
        return TransferMetrics(version=version, bytes=nbytes, seconds=time.perf_counter() - t0,
                               buckets=sent, tensors=n, servers=servers)

    @property
    def held_version(self) -> int | None:
        """The version pushed with ``hold`` and not committed yet, if some server took it."""
        return None if self._held is None else self._held[0]

    async def commit(self, version: int, *, pause_mode: str | None = None) -> None:
        """The servers that took ``version`` (pushed with ``hold``) serve it; with a
        ``pause_mode`` each pauses that way for the swap and continues right after."""
        if self._held is None or self._held[0] != version:
            raise RuntimeError(f"version {version} was not pushed with hold=True (holding "
                               f"{None if self._held is None else self._held[0]})")
        _, transfer_id, failed = self._held
        self._held = None
        await self.client.commit_weights(version, transfer_id, skip=failed, flush_cache=self.flush_cache,
                                         pause_mode=pause_mode)


async def _planned_buckets(tensors: Tensors, bucket_bytes: int) -> AsyncIterator[tuple[Bucket, bool]]:
    """``(bucket, is the last)`` in order, each gathered in a worker thread. With a ``layout`` the
    buckets are planned from it and the next one is gathered while the caller sends this one;
    otherwise the next one is gathered first, to learn whether this one is the last."""
    layout = getattr(tensors, "layout", None)
    if layout is None:
        groups = buckets(tensors, bucket_bytes)
        nxt = await asyncio.to_thread(next, groups, None)
        while nxt is not None:
            cur, nxt = nxt, await asyncio.to_thread(next, groups, None)
            yield cur, nxt is None
        return
    it = iter(tensors)
    counts = [len(b) for b in size_groups(layout, bucket_bytes, layout_nbytes)]
    ahead = None
    try:
        for i, count in enumerate(counts):
            cur = await ahead if ahead is not None else await asyncio.to_thread(_take, it, count)
            last = i + 1 == len(counts)
            ahead = None if last else asyncio.ensure_future(asyncio.to_thread(_take, it, counts[i + 1]))
            yield cur, last
    finally:
        if ahead is not None:
            # the gather in flight holds the iterator: let it finish before anyone else (a
            # multi-process run drains the rest) touches it
            await asyncio.gather(ahead, return_exceptions=True)


def _require_hf_layout(tensors: Tensors, who: str) -> None:
    if not getattr(tensors, "hf_layout", True):
        raise ValueError(f"{who} takes HF tensors; these keep our own kernel layout "
                         "(iter_hf_tensors(..., hf_layout=False), for HttpBucketSink only): pass hf_layout=True")


def _take(tensors: Iterator[tuple[str, np.ndarray]], count: int) -> list[tuple[str, np.ndarray]]:
    """The next ``count`` tensors (a bucket planned from the layout)."""
    out = list(itertools.islice(tensors, count))
    if len(out) != count:
        raise ValueError(f"the tensors ended {count - len(out)} short of the layout they announced")
    return out


class LocalSink(WeightSink):
    """Weights for an in-process engine through a ``LocalRolloutClient``."""

    def __init__(self, client: Any):
        self.client = client

    async def push_params(self, version: int, params: Any) -> TransferMetrics:
        """Hand the trainer's ``params`` (an ``nnx.State`` of device arrays) over on device. In the
        shared placement pass ``trainer.policy.lend()``: the engine may keep those very arrays."""
        m = await self.client.update_params(params, version=version)
        return TransferMetrics(version=version, bytes=m.bytes, seconds=m.seconds, buckets=0, tensors=m.tensors,
                               servers=1)

    async def push(self, version: int, tensors: Tensors) -> TransferMetrics:
        """HF-named host tensors, gathered off the event loop: the path through host memory."""
        _require_hf_layout(tensors, "LocalSink.push")
        t0 = time.perf_counter()
        named = await asyncio.to_thread(dict, tensors)
        await self.client.update_weights_from_tensors(named, version=version)
        return TransferMetrics(version=version, bytes=sum(a.nbytes for a in named.values()),
                               seconds=time.perf_counter() - t0, buckets=1, tensors=len(named), servers=1)
