"""The weight path's conversions between HF tensors and our parameters, done on the device, and
zero-copy reads of safetensors files.

Our kernels are ``[in, out]`` and decoder layers are stacked on a leading ``layers`` axis; HF
tensors are ``[out, in]``, one per layer. Every weight push converts a whole model between the
two layouts, on the trainer's side (``to_hf``) and on the server's (``from_hf``), so these run as
compiled XLA programs (a transpose there runs several times faster than NumPy's strided copy on
the host, and a cast fuses into it) and the host only copies contiguous bytes. Each compiled
program is cached by its layout change, dtype and sharding: a model has a handful of shapes.

``read_safetensors`` maps a file and returns its tensors as views of the mapping: the bytes are
read once, by the copy to the device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from areal_jax.models.layer_stack import LayerStack
from areal_jax.models.safetensors_codec import safetensors_views


def _swap_last_two(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


@functools.cache
def _to_hf_fn(stacked: bool, transpose: bool, dtype: Any, columns: bool) -> Any:
    def convert(value: jax.Array, layer: jax.Array, cols: jax.Array | None) -> jax.Array:
        x = value[layer] if stacked else value
        if columns:
            x = jnp.take(x, cols, axis=-1)
        return (_swap_last_two(x) if transpose else x).astype(dtype)

    return jax.jit(convert)


def to_hf(value: jax.Array, layer: int | None, transpose: bool, dtype: Any,
          cols: np.ndarray | None = None) -> jax.Array:
    """One HF tensor of a parameter, on the device: layer ``layer`` of a stacked parameter (the
    whole parameter for None), only output columns ``cols`` (a fused parameter's part; None: all),
    transposed to ``[out, in]`` if ``transpose``, cast to ``dtype``."""
    fn = _to_hf_fn(layer is not None, transpose, np.dtype(dtype), cols is not None)
    return fn(value, np.int32(layer or 0), None if cols is None else np.asarray(cols, np.int32))


def hf_sharding(sharding: Sharding, ndim: int, transpose: bool) -> Sharding | None:
    """Where to put a parameter's HF-layout bytes so that turning them into the parameter moves
    nothing between devices: the parameter's own named sharding with its last two axes swapped
    (None: anything else, which jit then places)."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    if transpose:
        spec[-2:] = spec[-1], spec[-2]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


@functools.cache
def _from_hf_fn(transpose: bool, dtype: Any, sharding: Sharding, partial: bool) -> Any:
    def whole(x: jax.Array) -> jax.Array:
        return (_swap_last_two(x) if transpose else x).astype(dtype)

    def some_layers(old: jax.Array, x: jax.Array, layers: jax.Array) -> jax.Array:
        return old.at[layers].set(whole(x))

    return jax.jit(some_layers if partial else whole, out_shardings=sharding)


def from_hf(old: jax.Array, blocks: Sequence[np.ndarray], layers: Sequence[int] | None, transpose: bool) -> jax.Array:
    """A new value of the parameter ``old`` from its HF tensors, with ``old``'s dtype and sharding.

    ``layers``: None for an unstacked parameter (``blocks`` is its one tensor); else the layer
    index of each block, and the layers not given keep ``old``'s values. The host stacks the
    blocks (a plain copy, into aligned memory), one transfer puts them on the devices in the HF
    layout (none on CPU), and a compiled program transposes and casts them there."""
    host = _aligned(blocks, stack=layers is not None)
    where = hf_sharding(old.sharding, host.ndim, transpose)
    # 64-byte aligned host bytes become a device array without a copy on the CPU backend (the copy
    # into fresh device memory ran at a fifth of memcpy speed); elsewhere it is the transfer.
    device = jax.device_put(host, where, may_alias=True) if where is not None else \
        jax.device_put(host, may_alias=True)
    if layers is None or list(layers) == list(range(old.shape[0])):
        return _from_hf_fn(transpose, old.dtype, old.sharding, False)(device)
    return _from_hf_fn(transpose, old.dtype, old.sharding, True)(_array(old), device, np.asarray(layers, np.int32))


def _array(old: Any) -> jax.Array:
    """``old`` as one array: a served parameter held one array per layer (``LayerStack``) stacked
    again, for an update of some of its layers."""
    return old.stacked() if isinstance(old, LayerStack) else old


@functools.cache
def _from_hf_fused_fn(transpose: bool, sharding: Sharding, spans: tuple[tuple[int, int], ...], complete: bool,
                      order: tuple[int, ...], inverse: tuple[int, ...]) -> Any:
    order_a, inverse_a = np.asarray(order, np.int32), np.asarray(inverse, np.int32)

    def fused(old: jax.Array, blocks: tuple[jax.Array, ...], layers: tuple[jax.Array | None, ...]) -> jax.Array:
        parts = [(_swap_last_two(x) if transpose else x).astype(old.dtype) for x in blocks]
        if complete:  # every part of every layer: no need to read the old values
            unfused = jnp.concatenate(parts, axis=-1)
        else:
            unfused = jnp.take(old, inverse_a, axis=-1)
            for (a, b), x, at in zip(spans, parts, layers, strict=True):
                unfused = unfused.at[..., a:b].set(x) if at is None else unfused.at[at, ..., a:b].set(x)
        return jnp.take(unfused, order_a, axis=-1)

    return jax.jit(fused, out_shardings=sharding)


def from_hf_fused(old: jax.Array, parts: Sequence[tuple[tuple[int, int], Sequence[np.ndarray], Sequence[int] | None]],
                  transpose: bool, order: np.ndarray, inverse: np.ndarray) -> jax.Array:
    """A new value of the fused parameter ``old`` (``models.fused``) from some of its parts' HF
    tensors, with ``old``'s dtype and sharding: ``parts`` holds, per part given, its column span in
    the unfused concatenation, its blocks and their layer indices (as ``from_hf``'s). Parts and
    layers not given keep ``old``'s values."""
    spans, blocks, layers = [], [], []
    stacked = False
    total = len(inverse)
    for span, part_blocks, part_layers in sorted(parts, key=lambda p: p[0]):
        stacked = part_layers is not None
        host = _aligned(part_blocks, stack=stacked)
        spans.append(tuple(span))
        blocks.append(jax.device_put(host, may_alias=True))
        every = not stacked or list(part_layers) == list(range(old.shape[0]))
        layers.append(None if every else np.asarray(part_layers, np.int32))
    covered = sum(b - a for a, b in spans) == total and all(at is None for at in layers)
    fn = _from_hf_fused_fn(transpose, old.sharding, tuple(spans), covered, tuple(int(x) for x in order),
                           tuple(int(x) for x in inverse))
    if isinstance(old, LayerStack) and covered:  # a complete update reads nothing of ``old`` but its dtype
        return fn(jnp.zeros((), old.dtype), tuple(blocks), tuple(layers))
    return fn(_array(old), tuple(blocks), tuple(layers))


def _aligned(blocks: Sequence[np.ndarray], *, stack: bool, align: int = 64) -> np.ndarray:
    """``blocks`` stacked (or the one block) in a fresh ``align``-byte aligned host array."""
    shape = (len(blocks), *blocks[0].shape) if stack else blocks[0].shape
    nbytes = int(np.prod(shape)) * blocks[0].dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    out = raw[start:start + nbytes].view(blocks[0].dtype).reshape(shape)
    if stack:
        np.stack(blocks, out=out)
    else:
        np.copyto(out, blocks[0])
    return out


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as read-only views of the file mapped into memory.

    Raises ``ValueError``, naming the file, for one that is not a safetensors file (see
    ``safetensors_codec.safetensors_views``)."""
    try:
        return safetensors_views(np.memmap(path, dtype=np.uint8, mode="r"))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
