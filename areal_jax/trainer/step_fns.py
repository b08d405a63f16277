"""The jitted steps of a learner (``trainer/learner.py``): one micro-batch's gradient added to an
accumulator, a forward pass, an AdamW update, a zero accumulator, as functions of what they are
traced from and nothing else, and the cache that lets learners of one configuration share them
(``shared_steps``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.trainer.config import TrainConfig
from sharding.rules import Rules

LossFn = Callable[[nnx.Module, dict, dict], tuple[jax.Array, dict]]
"""``(module, batch, scalars) -> (scaled loss, statistics)``: one micro-batch's share of the loss."""
ForwardFn = Callable[[nnx.Module, dict], jax.Array]
"""``(module, batch) -> [rows, length]`` per-position outputs (logprobs or values)."""

def _grad_step(graphdef: nnx.GraphDef, loss: LossFn, params: nnx.State, acc: nnx.State, batch: dict,
               scalars: dict) -> tuple[nnx.State, dict]:
    def loss_fn(p: nnx.State) -> tuple[jax.Array, dict]:
        return loss(nnx.merge(graphdef, p), batch, scalars)

    (scaled, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    aux["scaled_loss"] = scaled
    ok = jnp.isfinite(scaled)
    return jax.tree.map(lambda a, g: a + jnp.where(ok, g, jnp.nan), acc, grads), aux


def _forward_step(graphdef: nnx.GraphDef, forward: ForwardFn, params: nnx.State, batch: dict) -> jax.Array:
    return forward(nnx.merge(graphdef, params), batch)


def _apply_step(tx: optax.GradientTransformation, schedule: optax.Schedule, params: nnx.State,
                opt_state: Any, grads: nnx.State, step: jax.Array) -> tuple[nnx.State, Any, dict]:
    grad_norm = optax.tree.norm(grads)
    updates, new_state = tx.update(grads, opt_state, params)
    finite = jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return (keep(optax.apply_updates(params, updates), params), keep(new_state, opt_state),
            {"grad_norm": grad_norm, "skipped": jnp.logical_not(finite).astype(jnp.int32),
             "lr": jnp.asarray(schedule(step), jnp.float32)})


def _zeros(params: nnx.State) -> nnx.State:
    return jax.tree.map(jnp.zeros_like, params)


def _by_value(fn: Any) -> Any:
    """A loss or forward function as a key that compares by value: a ``functools.partial`` by
    its function and arguments (the trainer makes a new one per learner), anything else as it is."""
    if isinstance(fn, partial):
        keywords = tuple(sorted((k, _by_value(v)) for k, v in fn.keywords.items()))
        return fn.func, tuple(map(_by_value, fn.args)), keywords
    return fn


def _flat(tree: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


_STEPS: dict[Any, tuple] = {}
"""``shared_steps``' jitted functions by what they are traced from; the oldest go past ``_MAX_STEPS``."""
_MAX_STEPS = 64


def shared_steps(graphdef: nnx.GraphDef, loss: LossFn, forward: ForwardFn, tx: optax.GradientTransformation,
                 schedule: optax.Schedule, train: TrainConfig, mesh: Mesh, rules: Rules, shardings: nnx.State,
                 opt_shardings: Any, data_sharding: NamedSharding) -> tuple:
    """A learner's jitted steps (grad, forward, apply, apply keeping lent params, zeros), shared by
    every learner of the same model graph, loss, forward, optimizer (``train``, whose peak ``lr``
    the optimizer ``tx`` and ``schedule`` were built from), mesh, rules and shardings: such a
    learner traces and lowers exactly what another already did, so it takes that one's functions
    and the shapes they compiled (a tiny model's gradient step took 0.25 CPU-s to trace and 0.13
    to lower, per shape, before XLA saw it). Nothing of a learner's own state is held: the
    functions close over the graph, the loss, forward and optimizer only (the first learner's,
    equal by value to every later one's). A key that does not hash (a list inside a config)
    builds the learner its own."""
    ps, os_, ds = shardings, opt_shardings, data_sharding
    rep = NamedSharding(mesh, PartitionSpec())

    def build() -> tuple:
        apply = partial(_apply_step, tx, schedule)
        return (
            jax.jit(partial(_grad_step, graphdef, loss), in_shardings=(ps, ps, ds, rep), out_shardings=(ps, rep),
                    donate_argnums=(1,)),
            jax.jit(partial(_forward_step, graphdef, forward), in_shardings=(ps, ds), out_shardings=ds),
            jax.jit(apply, in_shardings=(ps, os_, ps, rep), out_shardings=(ps, os_, rep), donate_argnums=(0, 1)),
            # The same step for lent params: they stay alive (and unchanged) for whoever reads them.
            jax.jit(apply, in_shardings=(ps, os_, ps, rep), out_shardings=(ps, os_, rep), donate_argnums=(1,)),
            jax.jit(_zeros, out_shardings=ps),
        )

    try:
        key = (graphdef, _by_value(loss), _by_value(forward), train, mesh, rules, _flat(ps), _flat(os_), ds)
        hash(key)
    except TypeError:
        return build()
    steps = _STEPS.get(key)
    if steps is None:
        steps = _STEPS[key] = build()
        while len(_STEPS) > _MAX_STEPS:
            del _STEPS[next(iter(_STEPS))]
    return steps
