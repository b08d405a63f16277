"""Writing Hugging Face model directories: size-bounded safetensors shards with their index,
config.json and tokenizer files, to a local directory (assembled aside and renamed into place)
or a URL (any fsspec scheme, config.json last); and ``save_pretrained``, which in a multi-process
run spreads the tensors over the processes, each writing whole tensors into its own shards.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import TOKENIZER_FILES, iter_hf_tensors
from areal_jax.models.safetensors_codec import layout_nbytes, safetensors_header, tensor_bytes


def write_safetensors_shards(
    tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, max_shard_bytes: int,
    on_written: Callable[[str], None] | None = None,
) -> list[str]:
    """Write tensors into ``model-XXXXX-of-YYYYY.safetensors`` files and, for several, the index.
    ``on_written(file_name)`` is called after each file is complete (a remote export uploads it
    and deletes the local copy, so local disk holds one shard at a time).

    When ``tensors`` says its ``layout`` up front (``iter_hf_tensors`` does), each file's header
    is written first and every tensor's bytes go to disk as it is gathered, while the next one is
    gathered in a worker thread: host memory holds a few tensors, not the model, and gathering
    overlaps writing. Otherwise the tensors are collected, then written."""
    on_written = on_written or (lambda _: None)
    layout = getattr(tensors, "layout", None)
    # per file: (name, shape, dtype) entries of the layout, or the collected (name, array) pairs
    shards: list[list[Any]] = (list(size_groups(layout, max_shard_bytes, layout_nbytes)) if layout is not None
                               else list(size_groups(tensors, max_shard_bytes, lambda t: t[1].nbytes)))
    n = len(shards)
    fnames = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    with _gathered_ahead(tensors) if layout is not None else contextlib.nullcontext(None) as ahead:
        for i, fname in enumerate(fnames):
            shard, shards[i] = shards[i], []  # the host lets go of each shard once it is on disk
            if layout is not None:
                total += _write_streamed(out_dir / fname, shard, ahead)
            else:
                save_file(dict(shard), str(out_dir / fname), metadata=ST_METADATA)
                total += sum(a.nbytes for _, a in shard)
            on_written(fname)
            weight_map.update({entry[0]: fname for entry in shard})
    if n == 1:
        return fnames
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    on_written("model.safetensors.index.json")
    return fnames


ST_METADATA = {"format": "pt"}
"""The metadata HF's own writers put in a safetensors header (transformers checks for it)."""


T = TypeVar("T")


def size_groups(items: Iterable[T], limit: int, nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive groups of ``items`` of at most ``limit`` bytes each; a bigger item goes alone."""
    cur: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if cur and size + n > limit:
            yield cur
            cur, size = [], 0
        cur.append(item)
        size += n
    if cur:
        yield cur


def _write_streamed(path: Path, layout: list[tuple[str, tuple[int, ...], Any]],
                    tensors: Iterator[tuple[str, np.ndarray]]) -> int:
    """One safetensors file of ``layout``: the header, then each tensor's bytes as ``tensors``
    yields it (they must come in ``layout``'s order, with its shapes and dtypes). Returns the
    data bytes written."""
    total = 0
    with open(path, "wb") as f:
        f.write(safetensors_header(layout, ST_METADATA))
        for name, shape, dtype in layout:
            got = next(tensors, None)
            if got is None or got[0] != name or tuple(got[1].shape) != tuple(shape) or got[1].dtype != dtype:
                what = "the end" if got is None else f"{got[0]!r} {list(got[1].shape)} {got[1].dtype}"
                raise ValueError(f"{path.name}: expected tensor {name!r} {list(shape)} {np.dtype(dtype)} "
                                 f"(the stream's layout), got {what}")
            total += f.write(tensor_bytes(got[1]))
    return total


@contextlib.contextmanager
def _gathered_ahead(tensors: Iterator[Any], depth: int = 2) -> Iterator[Iterator[Any]]:
    """``tensors`` pulled ``depth`` items ahead in a worker thread (a gather runs while the
    previous tensor is written). On exit the worker stops after the item in hand and is joined,
    so the caller may go on iterating ``tensors`` itself (the collective gathers of a multi-process
    run must be finished by every process)."""
    items: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                items.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in tensors:
                if not put(item):
                    return
            put(end)
        except BaseException as e:  # raised in the caller's thread, at the item it reaches
            put(_Failed(e))

    def taken() -> Iterator[Any]:
        while True:
            item = items.get()
            if item is end:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item

    worker = threading.Thread(target=work, name="hf-gather", daemon=True)
    worker.start()
    try:
        yield taken()
    finally:
        stop.set()
        worker.join()


@dataclass
class _Failed:
    error: BaseException


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``scheme://`` address (``gs://``, ``s3://``, ``memory://``,
    ``file://``...), written and read through fsspec; anything else is a local path."""
    return "://" in os.fspath(path)


def _url_fs(url: str | os.PathLike) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it. Cloud schemes need their fsspec
    package (``gcsfs`` for gs://, ``s3fs`` for s3://); fsspec's error names the one missing."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(os.fspath(url))
    return fs, path.rstrip("/")


def _tokenizer_files(tokenizer_dir: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(name, source)`` of each tokenizer file present in a local directory or at a URL;
    ``source`` is a local ``Path`` or a ``(fs, path)`` pair."""
    if is_url(tokenizer_dir):
        fs, root = _url_fs(tokenizer_dir)
        for name in TOKENIZER_FILES:
            if fs.isfile(f"{root}/{name}"):
                yield name, (fs, f"{root}/{name}")
    else:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).exists():
                yield name, Path(tokenizer_dir) / name


def _read_bytes(source: Any) -> bytes:
    if isinstance(source, Path):
        return source.read_bytes()
    fs, path = source
    return fs.cat_file(path)


def _write_hf_url(
    tensors: Iterator[tuple[str, np.ndarray]], url: str, hf_config: dict[str, Any],
    tokenizer_dir: str | os.PathLike | None, max_shard_bytes: int,
) -> str:
    """``write_hf_dir`` for a URL. Object stores cannot rename a directory atomically, so the
    files go straight to ``url``, config.json last: a reader that finds config.json finds a
    complete checkpoint. Shards are written to a local temp dir and uploaded one at a time."""
    fs, root = _url_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:

            def upload(name: str) -> None:
                fs.put_file(os.path.join(tmp, name), f"{root}/{name}")
                os.remove(os.path.join(tmp, name))

            write_safetensors_shards(tensors, Path(tmp), max_shard_bytes, on_written=upload)
        if tokenizer_dir is not None:
            for name, source in _tokenizer_files(tokenizer_dir):
                fs.pipe_file(f"{root}/{name}", _read_bytes(source))
        fs.pipe_file(f"{root}/config.json", json.dumps(hf_config, indent=2).encode())
    except BaseException:
        try:
            fs.rm(root, recursive=True)
        except OSError:
            pass
        raise
    return os.fspath(url).rstrip("/")


def write_hf_dir(
    tensors: Iterator[tuple[str, np.ndarray]],
    out_dir: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Path | str:
    """Write a HF model directory (safetensors shards, config.json, tokenizer files).

    A local directory is assembled in a temporary sibling and renamed into place, atomically, so
    a reader (an SGLang server told to load it, say) never sees a half-written checkpoint; on
    error nothing is left behind. A URL (``gs://bucket/run/v3``, any fsspec scheme; see
    ``is_url``) is written file by file, config.json last, and removed on error; the URL is
    returned. ``tokenizer_dir`` may be a local directory or a URL too.
    """
    if is_url(out_dir):
        return _write_hf_url(tensors, os.fspath(out_dir), hf_config, tokenizer_dir, max_shard_bytes)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_safetensors_shards(tensors, tmp, max_shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if tokenizer_dir is not None:
            for name, source in _tokenizer_files(tokenizer_dir):
                if isinstance(source, Path):
                    shutil.copy2(source, tmp / name)
                else:
                    (tmp / name).write_bytes(_read_bytes(source))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_pretrained(
    model: Decoder,
    out_dir: str | os.PathLike,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 2 * 1024**3,
    tokenizer_dir: str | os.PathLike | None = None,
) -> Path | str:
    """Write ``model`` as a HF model directory loadable by ``transformers`` and SGLang.

    ``out_dir`` is a local directory (returned as a ``Path``) or a URL such as
    ``gs://bucket/run/final`` (any fsspec scheme with its package installed, e.g. ``gcsfs``;
    returned as given). ``dtype`` (a name or JAX/NumPy dtype; default the parameters' own) is
    the tensors' dtype on disk. Tokenizer files are copied from ``tokenizer_dir`` (default: the
    directory the model was loaded from). A model sharded over several processes' devices is
    exported by all of them together: every process must call this (the gathers are collective)
    and ``out_dir`` must be one place they all reach (a shared filesystem or a bucket); the
    tensors are spread over the processes by size, each tensor gathered to and written whole by
    one of them, into that process's own shards. A model on this process's devices alone (built
    here, say) is written by this process.
    """
    tokenizer_dir = tokenizer_dir or getattr(model, "source_dir", None)
    hf_config = model.config.to_hf_dict(dtype)
    if any(not x.is_fully_addressable for x in jax.tree.leaves(nnx.state(model))):
        # Sharded over several processes' devices: a collective export.
        return _save_spread(model, out_dir, dtype, hf_config, tokenizer_dir, max_shard_bytes)
    return write_hf_dir(iter_hf_tensors(model, dtype), out_dir, hf_config, tokenizer_dir=tokenizer_dir,
                        max_shard_bytes=max_shard_bytes)


def spread_plan(sizes: list[tuple[str, int]], processes: int, max_shard_bytes: int) -> list[tuple[int, list[str]]]:
    """The files of a multi-process export, in order, as ``(writing process, tensor names)``:
    tensors go largest first to the process with the fewest bytes so far; each process's
    tensors, in the model's order (``sizes`` is ``(name, bytes)`` in that order), are cut into
    files of at most ``max_shard_bytes`` (or one tensor, if larger)."""
    load, owner = [0] * processes, {}
    for name, nbytes in sorted(sizes, key=lambda t: -t[1]):
        p = min(range(processes), key=lambda i: load[i])
        owner[name] = p
        load[p] += nbytes
    files: list[tuple[int, list[str]]] = []
    for p in range(processes):
        names, size = [], 0
        for name, nbytes in sizes:
            if owner[name] != p:
                continue
            if names and size + nbytes > max_shard_bytes:
                files.append((p, names))
                names, size = [], 0
            names.append(name)
            size += nbytes
        if names:
            files.append((p, names))
    return files


def _save_spread(model: Decoder, out_dir: str | os.PathLike, dtype: Any, hf_config: dict[str, Any],
                 tokenizer_dir: str | os.PathLike | None, max_shard_bytes: int) -> Path | str:
    """``save_pretrained`` across processes. A local ``out_dir`` is assembled in a sibling
    staging directory and renamed into place by process 0; a URL is written in place, config.json
    last. Processes meet at three barriers: staging ready, every shard written, export done."""
    from jax.experimental.multihost_utils import sync_global_devices

    me = jax.process_index()
    sizes = [(entry[0], layout_nbytes(entry)) for entry in iter_hf_tensors(model, dtype).layout]
    files = spread_plan(sizes, jax.process_count(), max_shard_bytes)
    fnames = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    file_of = {name: i for i, (_, names) in enumerate(files) for name in names}
    if is_url(out_dir):
        fs, root = _url_fs(out_dir)
        result: Path | str = os.fspath(out_dir).rstrip("/")
        if me == 0:
            if fs.exists(root):
                fs.rm(root, recursive=True)
            fs.makedirs(root, exist_ok=True)
    else:
        out, fs, result = Path(out_dir), None, Path(out_dir)
        root = str(out.parent / f".{out.name}.tmp-export")
        if me == 0:
            shutil.rmtree(root, ignore_errors=True)
            Path(root).mkdir(parents=True)
    sync_global_devices(f"hf export {out_dir}: staging ready")

    def put(name: str, write: Callable[[str], None]) -> None:
        if fs is None:
            write(os.path.join(root, name))
            return
        with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
            write(os.path.join(tmp, name))
            fs.put_file(os.path.join(tmp, name), f"{root}/{name}")

    pending: dict[int, dict[str, np.ndarray]] = {i: {} for i, (p, _) in enumerate(files) if p == me}
    for name, arr in iter_hf_tensors(model, dtype, owned=lambda n: file_of[n] in pending):
        shard = pending[file_of[name]]
        shard[name] = arr
        if len(shard) == len(files[file_of[name]][1]):  # the file is complete: write it, let it go
            put(fnames[file_of[name]], lambda path, shard=shard: save_file(
                shard, path, metadata={**ST_METADATA, "written_by_process": str(me)}))
            del pending[file_of[name]]
    sync_global_devices(f"hf export {out_dir}: shards written")
    if me == 0:
        index = {"metadata": {"total_size": sum(n for _, n in sizes)},
                 "weight_map": {name: fnames[file_of[name]] for name, _ in sizes}}
        put("model.safetensors.index.json", lambda path: Path(path).write_text(json.dumps(index, indent=2)))
        for name, source in _tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else ():
            put(name, lambda path, source=source: Path(path).write_bytes(_read_bytes(source)))
        put("config.json", lambda path: Path(path).write_text(json.dumps(hf_config, indent=2)))
        if fs is None:
            if Path(out_dir).exists():
                shutil.rmtree(out_dir)
            os.replace(root, out_dir)
    sync_global_devices(f"hf export {out_dir}: done")
    return result
