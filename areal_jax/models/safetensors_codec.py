"""The safetensors codec: tensors to and from the safetensors layout (an 8-byte little-endian
header length, a JSON header, the raw little-endian data back to back), bfloat16 included, with
no copy where a view will do. The model's checkpoint reader and writer and the weight buckets of
an HTTP push (``rollout_bridge.protocol``) share it."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["ST_DTYPES", "encode_tensor_bucket", "layout_nbytes", "safetensors_header", "safetensors_views",
           "tensor_bucket_parts", "tensor_bytes"]

ST_DTYPES: dict[str, Any] = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                             "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                             "BOOL": np.bool_}
"""safetensors dtype tags -> NumPy dtypes (bfloat16 is ``ml_dtypes.bfloat16``)."""

_ST_TAGS = {np.dtype(v): k for k, v in ST_DTYPES.items()}


def layout_nbytes(entry: tuple[str, tuple[int, ...], Any]) -> int:
    """Bytes of one ``(name, shape, dtype)`` layout entry (``HFTensorStream.layout``)."""
    _, shape, dtype = entry
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def safetensors_header(layout: Iterable[tuple[str, tuple[int, ...], Any]],
                       metadata: dict[str, str] | None = None) -> bytes:
    """The first bytes of a safetensors buffer holding tensors of ``layout`` (name, shape, NumPy
    dtype; bfloat16 is ``ml_dtypes.bfloat16``) back to back in that order: the header's length,
    then the JSON header, padded so that the data starts 8-byte aligned, as the format asks."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in layout:
        dtype = np.dtype(dtype)
        tag = _ST_TAGS.get(dtype.newbyteorder("="))
        if tag is None:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors tag")
        nbytes = layout_nbytes((name, shape, dtype))
        header[name] = {"dtype": tag, "shape": [int(d) for d in shape], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head


def tensor_bytes(arr: np.ndarray) -> memoryview:
    """A view of ``arr``'s bytes in C order (copied only if it is not C-contiguous)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def tensor_bucket_parts(tensors: dict[str, np.ndarray] | list[tuple[str, np.ndarray]]) -> list[bytes | memoryview]:
    """One bucket in safetensors layout as the pieces to send one after another, copying nothing:
    the header, then a view of every tensor's bytes (bfloat16 arrays are ``ml_dtypes.bfloat16``)."""
    items = [(k, np.ascontiguousarray(v)) for k, v in (tensors.items() if isinstance(tensors, dict) else tensors)]
    head = safetensors_header((name, arr.shape, arr.dtype) for name, arr in items)
    return [head, *(tensor_bytes(arr) for _, arr in items)]


def encode_tensor_bucket(tensors: dict[str, np.ndarray] | list[tuple[str, np.ndarray]]) -> bytes:
    """One bucket as safetensors bytes, copied once (the library's ``save`` copies twice)."""
    return b"".join(tensor_bucket_parts(tensors))


def safetensors_views(buffer: Any) -> dict[str, np.ndarray]:
    """The tensors of a buffer in safetensors layout (8-byte little-endian header length, JSON
    header, raw little-endian data) as views into it: bytes, a memoryview or a memory-mapped file.
    ``safetensors.numpy.load`` cannot read BF16, so the format is read here.

    Raises ``ValueError`` naming what is wrong: too short, a bad header, a dtype not in
    ``ST_DTYPES``, offsets that do not hold the tensor's shape."""
    raw = buffer.view(np.uint8) if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
    if raw.size < 8:
        raise ValueError(f"{raw.size} bytes is too short for a safetensors buffer")
    n = int(raw[:8].view("<u8")[0])
    if n > raw.size - 8:
        raise ValueError(f"not a safetensors buffer: header of {n} bytes in {raw.size} bytes")
    try:
        header = json.loads(raw[8:8 + n].tobytes())
    except ValueError as e:
        raise ValueError(f"not a safetensors buffer: bad JSON header ({e})") from None
    data, out = raw[8 + n:], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {info.get('dtype')!r} is not supported; "
                             f"use one of {sorted(ST_DTYPES)}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if not 0 <= start <= end <= data.size or end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise ValueError(f"tensor {name!r}: offsets {[start, end]} do not hold shape {list(shape)}")
        out[name] = data[start:end].view(np.dtype(dtype).newbyteorder("<")).reshape(shape)
    return out
