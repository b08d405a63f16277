"""Fused projections: q/k/v as one matmul and gate/up as one, for serving.

A decode step is a few tokens against every weight: each projection is its own kernel launch
and its own pass over the activations. With ``ModelConfig.fuse_projections`` an attention layer
holds one ``qkv_proj`` kernel ``[hidden, q + 2 kv]`` and an MLP one ``gate_up_proj``
``[hidden, 2 intermediate]``, so a layer runs three fewer matmuls. Training keeps the separate
parameters (the trainer's optimizer state, checkpoints and sharding rules stay as they are); the
serving side builds the fused form at load (``load_pretrained(..., fuse_projections=True)``) or
from an unfused model or state (``fuse_projections``, ``fuse_state``), and HF tensors in and out
keep their own names (``hf_io`` maps each HF tensor to its columns of the fused kernel).

The fused columns are laid out per tensor-parallel shard: for ``shards`` shards, shard ``s``
holds its own query heads, then the KV heads they read, then those heads' values (and for the
MLP its gate columns, then its up columns), so splitting the fused axis over the tensor mesh
axis gives each device exactly the columns it computes with, and splitting q, k and v apart
needs no communication. When the mesh is wider than the KV heads each shard holds a copy of the
KV head its queries read (the replication ``kv_head_replicas`` does for the unfused model).
One shard is plain ``[q | k | v]`` and ``[gate | up]``.

A layout is an ``order``: fused column ``j`` is column ``order[j]`` of the unfused parts
concatenated (``[q | k | v]`` or ``[gate | up]``); a column may appear more than once (the
replicated KV heads).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

if TYPE_CHECKING:
    from areal_jax.models.config import ModelConfig
    from areal_jax.models.decoder import Decoder


@dataclass(frozen=True)
class FusedLayout:
    """One fused parameter family: the unfused modules it replaces, in concatenation order, their
    output widths, and the fused column order (see the module docstring)."""

    module: str
    """The fused module's name (``qkv_proj``, ``gate_up_proj``)."""
    parts: tuple[str, ...]
    """The unfused modules, in the order their columns are concatenated."""
    widths: tuple[int, ...]
    order: tuple[int, ...]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(int(x) for x in np.cumsum((0,) + self.widths[:-1]))

    def columns(self, part: str) -> tuple[int, int]:
        """``part``'s column range in the unfused concatenation."""
        i = self.parts.index(part)
        return self.starts[i], self.starts[i] + self.widths[i]

    def order_array(self) -> np.ndarray:
        return np.asarray(self.order, np.int32)

    def inverse(self) -> np.ndarray:
        """For each unfused column, the first fused column holding it (the unfused parts from
        the fused kernel: ``fused[..., inverse]``)."""
        order = self.order_array()
        inv = np.full(sum(self.widths), -1, np.int32)
        # Reversed, so the first occurrence of a column is the one written last.
        inv[order[::-1]] = np.arange(len(order) - 1, -1, -1, dtype=np.int32)
        assert (inv >= 0).all(), "a fused layout must hold every unfused column"
        return inv


def qkv_shards(num_heads: int, num_kv_heads: int, shards: int) -> int:
    """The shard count a fused q/k/v layout is built for: ``shards`` when every shard can hold
    whole query heads and whole (or replicated) KV heads, else 1 (the plain layout, still correct
    under any mesh; only its split is then not local)."""
    if shards > 1 and num_heads % shards == 0 and (num_kv_heads % shards == 0 or shards % num_kv_heads == 0):
        return shards
    return 1


@functools.cache
def qkv_layout(num_heads: int, num_kv_heads: int, head_dim: int, shards: int) -> FusedLayout:
    """The fused q/k/v columns for ``shards`` tensor shards (see the module docstring)."""
    nq, nk = num_heads * head_dim, num_kv_heads * head_dim
    q = np.arange(nq).reshape(shards, -1)
    if shards <= num_kv_heads:
        k = nq + np.arange(nk).reshape(shards, -1)
    else:  # each shard holds one KV head: head s // replicas
        heads = np.arange(shards) // (shards // num_kv_heads)
        k = nq + heads[:, None] * head_dim + np.arange(head_dim)[None]
    order = np.concatenate([q, k, k + nk], axis=1).reshape(-1)
    return FusedLayout("qkv_proj", ("q_proj", "k_proj", "v_proj"), (nq, nk, nk), tuple(int(x) for x in order))


def mlp_shards(intermediate_size: int, shards: int) -> int:
    """The shard count a fused gate/up layout is built for (1 when the columns do not split evenly)."""
    return shards if shards > 1 and intermediate_size % shards == 0 else 1


@functools.cache
def gate_up_layout(intermediate_size: int, shards: int) -> FusedLayout:
    """The fused gate/up columns for ``shards`` tensor shards: each shard's gate, then its up."""
    gate = np.arange(intermediate_size).reshape(shards, -1)
    order = np.concatenate([gate, gate + intermediate_size], axis=1).reshape(-1)
    return FusedLayout("gate_up_proj", ("gate_proj", "up_proj"), (intermediate_size,) * 2,
                       tuple(int(x) for x in order))


def layouts(cfg: ModelConfig, shards: tuple[int, int]) -> dict[str, FusedLayout]:
    """The fused layouts of a model of ``cfg`` built for ``shards`` (attention, MLP), by module name."""
    qkv = qkv_layout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, shards[0])
    gate_up = gate_up_layout(cfg.intermediate_size, shards[1])
    return {qkv.module: qkv, gate_up.module: gate_up}


# --- building fused parameters ------------------------------------------------------------------

@functools.cache
def _fuse_fn(order: tuple[int, ...], sharding: Any) -> Any:
    index = np.asarray(order, np.int32)

    def fuse(*parts: jax.Array) -> jax.Array:
        return jnp.take(jnp.concatenate(parts, axis=-1), index, axis=-1)

    return jax.jit(fuse, out_shardings=sharding)


def fuse_arrays(layout: FusedLayout, parts: list[jax.Array]) -> jax.Array:
    """The fused parameter from its unfused parts (stacked or not; the last axis is the output's),
    on the first part's sharding."""
    sharding = parts[0].sharding if isinstance(parts[0].sharding, NamedSharding) else None
    return _fuse_fn(layout.order, sharding)(*parts)


def _axis_shards(x: Any) -> int:
    """How many ways ``x``'s last axis is split over its mesh (1 off a mesh)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or len(sharding.spec) < x.ndim:
        return 1
    axes = sharding.spec[x.ndim - 1]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([sharding.mesh.shape[a] for a in axes], dtype=np.int64))


def fuse_state(fused: Decoder, state: nnx.State) -> nnx.State:
    """``state`` (an unfused model's parameters, e.g. a trainer's) in the tree of the fused model
    ``fused``: the fused parameters built on the devices where their parts are (on the query's and
    the gate's sharding), every other array passed through as it is. A state already fused is
    returned unchanged."""
    flat = dict(nnx.to_flat_state(state))
    fused_layouts = fused.fused_layouts()
    out = []
    for path, var in nnx.to_flat_state(nnx.state(fused)):
        path = tuple(path)
        if path in flat:
            out.append((path, flat[path]))
            continue
        layout = fused_layouts.get(str(path[-2])) if len(path) >= 2 else None
        parts = [flat.get((*path[:-2], part, path[-1])) for part in (layout.parts if layout else ())]
        if layout is None or any(p is None for p in parts):
            raise ValueError(f"fuse_state: parameter {'.'.join(map(str, path))} of the fused model has no "
                             f"source in the given state; give the unfused parameters of the same model")
        out.append((path, var.replace(fuse_arrays(layout, [p.get_value() for p in parts]))))
    return nnx.from_flat_state(out)


def fuse_projections(model: Decoder) -> Decoder:
    """A fused copy of an unfused ``model`` for serving (``model`` itself if already fused):
    laid out for the tensor split its parameters already have, the fused parameters on the query's
    and the gate's sharding, every other array shared with ``model``."""
    from areal_jax.models.decoder import Decoder

    if model.config.fuse_projections:
        return model
    cfg = model.config.replace(fuse_projections=True)
    shards = (_axis_shards(model.layers.self_attn.q_proj.kernel.get_value()),
              _axis_shards(model.layers.mlp.gate_proj.kernel.get_value()))
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), fused_shards=shards))
    graphdef, _ = nnx.split(abstract)
    out = nnx.merge(graphdef, fuse_state(abstract, nnx.state(model)))
    if hasattr(model, "source_dir"):
        out.source_dir = model.source_dir
    return out
