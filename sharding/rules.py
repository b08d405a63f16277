"""The logical-axis table and helpers that place arrays and pytrees on a mesh by logical names.

Models name their axes logically; only this table knows mesh axes. A rule maps one logical name
to a mesh axis, a tuple of mesh axes, or None (replicated).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import flax.core.spmd as flax_spmd
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

DEFAULT_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_batch", ("data", "fsdp")),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("layers", None),
)


def logical_to_spec(names: Sequence[str | None], rules: Rules = DEFAULT_RULES) -> PartitionSpec:
    """PartitionSpec for logical axis names; unknown names are an error, None stays replicated."""
    table = dict(rules)
    out: list[Any] = []
    used: set[str] = set()
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        target = table[name]
        # A mesh axis may shard only one array dimension: later uses fall back to replication.
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*out)


def logical_to_sharding(names: Sequence[str | None], mesh: Mesh, rules: Rules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules))


@contextlib.contextmanager
def activate(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Make ``mesh`` current and ``rules`` the logical table: NNX variables created inside are
    sharded at creation, and ``constrain`` calls inside jitted code take effect."""
    if mesh is None:
        yield
        return
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def logical_axis_size(name: str) -> int:
    """How many ways the current mesh splits logical axis ``name`` under the active rules; 1
    outside ``activate``. Lets a model shape itself to the mesh (e.g. replicate KV heads when
    the tensor axis is wider than their number)."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return 1
    axes = logical_to_spec((name,), rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = dict(mesh.shape)
    return math.prod(sizes[a] for a in axes)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside ``activate``."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if mesh.empty or not rules:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def shardings_of(state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """A ``NamedSharding`` for every variable of an NNX state, from its logical axis names (the
    ``out_sharding`` metadata the model gave it); a variable without names is replicated."""
    return jax.tree.map(
        lambda v: logical_to_sharding(v.get_metadata().get("out_sharding") or (), mesh, rules),
        state, is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def resharded(x: jax.Array, names: tuple[str | None, ...] | None, grad_names: tuple[str | None, ...]) -> jax.Array:
    """``x`` constrained to the sharding of logical ``names`` (None: as it is), its cotangent to
    that of ``grad_names`` (a plain constraint gives the cotangent the value's own sharding). A
    weight read whole (``names`` all None) inside a loop keeps its gradient in its own shards:
    each iteration's part is reduce-scattered into them, and nothing is gathered back whole.
    Both are no-ops outside a mesh."""
    return x if names is None else constrain(x, names)


def _resharded_fwd(x: jax.Array, names: tuple[str | None, ...] | None,
                   grad_names: tuple[str | None, ...]) -> tuple[jax.Array, None]:
    return resharded(x, names, grad_names), None


def _resharded_bwd(names: tuple[str | None, ...] | None, grad_names: tuple[str | None, ...], _: None,
                   g: jax.Array) -> tuple[jax.Array]:
    return (constrain(g, grad_names),)


resharded.defvjp(_resharded_fwd, _resharded_bwd)
