"""The serving layout of the decoder's layer parameters: one array per layer.

The model keeps each layer parameter stacked on a leading ``layers`` axis, so training scans over
layers and compiles one layer body. Serving reads the weights once per generated token, and there
the stack costs bandwidth: inside a loop over layers, XLA materialises each layer's slice of a
stacked weight (on a GPU a device-to-device copy of the whole layer weight, every decode step)
before the matmul reads it. Measured on an H200 at Qwen2.5-7B's shapes, that copy was 13 GB read
and written per step beside the 15.2 GB of weights read (docs/results.md).

An engine therefore holds each stacked parameter as a ``LayerStack``: the same values as one
array per layer, each its own buffer, which the layer loop reads in place. ``LayerStack`` is a
pytree node (its children are the layers' arrays) that answers ``shape``, ``dtype`` and
``sharding`` as the stacked array would, so code that only inspects a parameter (checks, weight
staging, placement reports) works on either layout. ``split_layers`` turns a state's stacked
parameters into stacks of layers, ``stacked_view`` describes a split state as stacked arrays, and
``layer_modules`` gives a stacked-layers module's layers to loop over when they are split.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, Sharding

__all__ = ["LayerStack", "join_layers", "layer_modules", "split_layers", "stacked_view"]


@jax.tree_util.register_pytree_node_class
class LayerStack:
    """A parameter of ``len(layers)`` layers held as one array per layer (see the module docstring)."""

    def __init__(self, layers: Sequence[Any]):
        # No checks here: jax rebuilds pytree nodes with placeholders (tracers, shardings, None).
        self.layers = tuple(layers)

    def tree_flatten(self) -> tuple[tuple[Any, ...], None]:
        return self.layers, None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Sequence[Any]) -> LayerStack:
        del aux
        return cls(children)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.layers), *self.layers[0].shape)

    @property
    def dtype(self) -> Any:
        return self.layers[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.layers)

    @property
    def sharding(self) -> Sharding:
        """The sharding of the stacked array these layers make: each layer's, unsplit on ``layers``."""
        return _stacked_sharding(self.layers[0].sharding, self.layers[0].ndim)

    def stacked(self) -> jax.Array:
        """The layers as one stacked array (a copy), on ``sharding``."""
        return _stack_fn(self.sharding)(self.layers)

    def __repr__(self) -> str:
        return f"LayerStack({len(self.layers)} x {tuple(self.layers[0].shape)} {self.dtype})"


def _stacked_sharding(layer: Sharding, ndim: int) -> Sharding:
    del ndim
    if isinstance(layer, NamedSharding):
        return NamedSharding(layer.mesh, PartitionSpec(None, *layer.spec), memory_kind=layer.memory_kind)
    return layer  # one device (or fully replicated): the same placement stacked


def _layer_sharding(stacked: Sharding, ndim: int) -> Sharding:
    """The sharding of one layer's slice of an array placed on ``stacked`` (rank ``ndim``)."""
    del ndim
    if isinstance(stacked, NamedSharding):
        spec = tuple(stacked.spec)
        if spec and spec[0] is not None:
            raise ValueError(f"a parameter split over devices on its layers axis ({stacked.spec}) cannot be served "
                             "one array per layer; shard the layers axis of the engine's mesh rules to None")
        return NamedSharding(stacked.mesh, PartitionSpec(*spec[1:]), memory_kind=stacked.memory_kind)
    return stacked


@functools.cache
def _stack_fn(sharding: Sharding) -> Any:
    return jax.jit(lambda layers: jnp.stack(layers), out_shardings=sharding)


@functools.cache
def _split_fn(n: int, shardings: tuple[Sharding, ...]) -> Any:
    return jax.jit(lambda x: tuple(x[i] for i in range(n)), out_shardings=shardings)


@functools.cache
def _split_into_fn(n: int, shardings: tuple[Sharding, ...]) -> Any:
    # The old layers are donated and, unused, kept as parameters (``keep_unused``): XLA then
    # writes each new layer into the buffer of the old one of its shape, dtype and sharding.
    return jax.jit(lambda old, x: tuple(x[i] for i in range(n)), out_shardings=shardings, donate_argnums=0,
                   keep_unused=True)


def _split(x: jax.Array, like: LayerStack | None, reuse: bool = False) -> LayerStack:
    n = x.shape[0]
    if reuse and like is not None and x.sharding.device_set == like.layers[0].sharding.device_set:
        return LayerStack(_split_into_fn(n, tuple(old.sharding for old in like.layers))(like.layers, x))
    own = _layer_sharding(x.sharding, x.ndim)
    layers = _split_fn(n, (own,) * n)(x)
    if like is not None:
        layers = tuple(jax.device_put(y, old.sharding) for y, old in zip(layers, like.layers, strict=True))
    return LayerStack(layers)


def _is_stack(x: Any) -> bool:
    return isinstance(x, LayerStack)


def split_layers(state: Any, like: Any = None, *, consume: bool = False, reuse: bool = False) -> Any:
    """``state`` (an ``nnx.State`` of a ``Decoder``, or its ``layers`` part) with every stacked
    layer parameter held as a ``LayerStack``; parameters already split pass through.

    Which leaves split: with ``like`` (a split state of the same tree), those ``like`` holds as a
    ``LayerStack``, each layer placed on ``like``'s layer's sharding; without, every leaf under a
    ``layers`` key. ``consume``: the caller owns the stacked arrays, and each is deleted as soon as
    it is split (so splitting a whole model holds one parameter twice at most, not the model).
    ``reuse``: ``like``'s layer arrays are donated, each new layer written into the buffer of the
    one it replaces (on the same devices; elsewhere a copy as without), so no second copy of the
    layer parameters is ever held; those of ``like`` that are split into are deleted, and nothing
    may read them after (an engine swapping its weights under its locks). Check the state first
    (shapes, dtypes): a parameter split before a failing one has taken its old buffers."""
    paths_leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_stack)
    if like is not None:
        olds = jax.tree.leaves(like, is_leaf=_is_stack)
        if len(olds) != len(paths_leaves):
            raise ValueError(f"split_layers: the state has {len(paths_leaves)} parameters, the served one "
                             f"{len(olds)}")
        targets = [isinstance(old, LayerStack) for old in olds]
    else:
        targets = [_under_layers(path) for path, _ in paths_leaves]
        olds = [None] * len(paths_leaves)
    out = []
    for (_, x), split, old in zip(paths_leaves, targets, olds, strict=True):
        if split and not isinstance(x, LayerStack):
            y = _split(x, old, reuse)
            if consume and isinstance(x, jax.Array):
                x.delete()
            x = y
        out.append(x)
    return jax.tree.unflatten(jax.tree.structure(state, is_leaf=_is_stack), out)


def _under_layers(path: tuple[Any, ...]) -> bool:
    return any(getattr(k, "key", getattr(k, "name", None)) == "layers" for k in path)


def stacked_view(state: Any) -> Any:
    """``state`` with each ``LayerStack`` described as the stacked array it stands for (a
    ``jax.ShapeDtypeStruct`` with its shape, dtype and sharding): the tree a stacked state of the
    same model has, for comparing and placing one against it."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if _is_stack(x) else x,
                        state, is_leaf=_is_stack)


def join_layers(state: Any) -> Any:
    """``state`` with each ``LayerStack`` stacked again into one array (a copy)."""
    return jax.tree.map(lambda x: x.stacked() if _is_stack(x) else x, state, is_leaf=_is_stack)


def layer_modules(layers: nnx.Module) -> list[nnx.Module] | None:
    """The layers of a stacked-layers module (``Decoder.layers``) as one module each, when its
    parameters are held as ``LayerStack`` s (the serving layout); None when they are stacked
    arrays, which a scan reads."""
    graphdef, params = nnx.split(layers)
    leaves = jax.tree.leaves(params, is_leaf=_is_stack)
    stacks = [x for x in leaves if _is_stack(x)]
    if not stacks:
        return None
    n = len(stacks[0].layers)
    return [nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x.layers[i] if _is_stack(x) else x[i], params,
                                             is_leaf=_is_stack)) for i in range(n)]
