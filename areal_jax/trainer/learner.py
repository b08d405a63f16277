"""A learner: one trained model's float32 master params on a mesh, its AdamW and that optimizer's
state (sharded like the params), and the jitted functions that train it. The trainer builds one
for the policy and, for PPO with a critic, one for the critic; a learner's ``state()`` is what a
checkpoint saves of it.

Three jitted functions per learner, each compiled once per length bucket at most:

- ``grad(acc, batch, scalars)``: adds one micro-batch's gradient of the (already scaled) loss
  to the accumulator. A non-finite loss poisons the sum, so the apply step skips the update even
  where masking kept the gradient itself finite.
- ``forward(batch)``: logprobs for the policy, values for the critic.
- ``apply(acc)``: one AdamW step, skipped on device when the gradient holds a NaN or inf (params
  and optimizer state come back as they were). It returns the gradient norm, whether it skipped
  and the learning rate it used, as device scalars the caller reads with the rest of its stats.

Donation: ``apply`` donates the params and optimizer state it replaces, so an update never holds
two copies. A learner therefore owns its params outright: it copies the module it is given (the
caller's arrays, which an engine may be serving, are never donated), and params handed out with
``lend()`` (to an in-process engine, with no copy) are not donated by the next update, which
writes new buffers instead; the reader frees the old ones when it lets go of them.

Learners of one model graph, loss, optimizer configuration, mesh and shardings share these
functions (``shared_steps``), and with them every shape one of them compiled: the memory plan's
abstract learner and the trainer's real one, or a test's many trainers, trace a step once.

A learner can be abstract (``jax.ShapeDtypeStruct`` params and optimizer state, nothing
allocated) to lower and compile its steps for the memory plan (``trainer/memory.py``); its
``use_remat`` rebuilds the steps under another remat policy. A frozen copy (``copy_params``,
``place_frozen``: a reference model) holds each weight in the dtype its layer computes in.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.models.config import remat_policy
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.step_fns import ForwardFn, LossFn, shared_steps
from sharding import activate, logical_to_sharding, put_from_host, shardings_of
from sharding.rules import Rules

_DECAYED = ("kernel", "embedding")


def decayed(params: Any) -> Any:
    """Weight decay applies to matrices (kernels, embeddings), never to norms or biases. Decided by
    name, not rank: stacked layers give a norm scale a leading ``layers`` axis."""
    def leaf_name(path: tuple[Any, ...]) -> str:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        keys = [k for k in keys if k not in ("value", "raw_value")]  # a Variable's own leaf
        return keys[-1] if keys else ""

    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) in _DECAYED, params)


def adamw(train: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping (when ``grad_clip``) then AdamW with decay on matrices only."""
    return optax.chain(
        optax.clip_by_global_norm(train.grad_clip) if train.grad_clip else optax.identity(),
        optax.adamw(schedule, b1=train.betas[0], b2=train.betas[1], eps=train.eps,
                    weight_decay=train.weight_decay, mask=decayed),
    )


def describe_optimizer(train: TrainConfig) -> str:
    """One line saying the optimizer ``adamw`` builds from ``train``, for the run's log: its
    defaults are not ``optax.adamw``'s (learning rate 1e-6, weight decay 0.01 on matrices only,
    clipping at 1.0; optax's has no clipping and decays every parameter by 1e-4)."""
    clip = f"global-norm clipping at {train.grad_clip:g}, then " if train.grad_clip else "no clipping, "
    sched = (f"warmup_cosine (warmup {train.warmup_steps}, over {train.total_steps} optimizer steps, "
             f"down to {train.min_lr_ratio:g} x lr)" if train.lr_schedule == "warmup_cosine"
             else f"constant after {train.warmup_steps} warmup steps")
    return (f"optimizer: {clip}AdamW lr {train.lr:g} ({sched}), betas ({train.betas[0]:g}, {train.betas[1]:g}), "
            f"eps {train.eps:g}, weight decay {train.weight_decay:g} on matrices only (train.*)")


def place(state: nnx.State, shardings: Any, dtypes: Any = None) -> nnx.State:
    """Float32 copies of ``state`` on ``shardings`` (or, where ``dtypes``, a prefix tree like
    ``shardings``, says so, copies in that dtype): never the caller's own buffers (the apply
    step donates these), one leaf at a time so the transient is one tensor. In a multi-process
    run a leaf held whole by each process (a model built on the host, the same everywhere) goes
    to this process's devices only."""
    def copy(x: Any, s: NamedSharding, dtype: Any) -> jax.Array:
        if not s.is_fully_addressable and (not isinstance(x, jax.Array) or x.is_fully_addressable):
            host = np.asarray(x, np.float32).astype(dtype)
            return jax.make_array_from_callback(host.shape, s, lambda index: host[index])
        return jax.device_put(jnp.asarray(x, dtype), s, may_alias=False)

    if dtypes is None:
        dtypes = jax.tree.map(lambda _: jnp.float32, shardings)
    # ``shardings`` has one leaf per variable: a prefix of ``state``.
    return jax.tree.map(lambda s, d, var: jax.tree.map(lambda x: copy(x, s, d), var), shardings, dtypes, state)


def abstract_params(state: nnx.State, shardings: Any) -> nnx.State:
    """What ``place`` would make of ``state``, as ``jax.ShapeDtypeStruct`` leaves: no memory."""
    def spec(x: Any, s: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=s)

    return jax.tree.map(lambda s, var: jax.tree.map(lambda x: spec(x, s), var), shardings, state)


def compute_cast_mask(graphdef: nnx.GraphDef, params: nnx.State, dtype: Any) -> Any:
    """One bool per variable of ``params`` (a prefix tree, like the shardings): True for the
    weights of a layer that computes in ``dtype`` (a ``Linear`` or ``Embed`` whose ``dtype`` it
    is) and would cast them to it itself. A layer kept in float32 on purpose (a critic's value
    head) is left alone."""
    module = nnx.merge(graphdef, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    cast: set[tuple[Any, ...]] = set()
    for path, node in nnx.iter_graph(module):
        layer_dtype = getattr(node, "dtype", None)
        if isinstance(node, (nnx.Linear, nnx.Embed)) and layer_dtype is not None \
                and jnp.dtype(layer_dtype) == jnp.dtype(dtype):
            cast.update((*path, name) for name in ("kernel", "bias", "embedding"))

    def key(path: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)

    return jax.tree_util.tree_map_with_path(lambda path, _: key(path) in cast, nnx.split(module)[1],
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def opt_state_shardings(tx: optax.GradientTransformation, params: nnx.State, shardings: Any,
                        replicated: NamedSharding) -> Any:
    """Moment buffers are sharded like their parameter, scalars (step count) replicated.

    An optimizer-state leaf belongs to the parameter whose tree path ends its own path
    (``...mu['layers'][0]['mlp']...`` ends with the param's path); jit alone would leave the
    freshly made zeros on one device.
    """
    # Variables' ``.value`` shows in the paths of params and optimizer state, not of the
    # shardings tree: paths are compared without it.
    def keystr(path: Any) -> str:
        return jax.tree_util.keystr(tuple(
            k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")))

    shapes = {keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
    by_path = {keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
    if set(by_path) != set(shapes):
        differ = sorted(set(by_path) ^ set(shapes))[:5]
        raise ValueError(f"parameter and sharding trees differ: {', '.join(differ)}")

    def pick(path: Any, leaf: jax.ShapeDtypeStruct) -> NamedSharding:
        key = keystr(path)
        hits = [k for k in by_path if key.endswith(k) and shapes[k] == leaf.shape]
        return by_path[max(hits, key=len)] if hits else replicated

    return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))


@lru_cache(maxsize=32)
def _abstract_graphdef(cls: type[nnx.Module], cfg: Any, mesh: Mesh, rules: Rules) -> nnx.GraphDef:
    """The graph of ``cls(cfg)`` built abstractly under ``mesh`` and ``rules``: the same for every
    learner of that model (GraphDefs are immutable and compare by value). Built once: it was 0.12
    of the 0.58 CPU-s of building a tiny model's ``Trainer`` (policy and reference), and a test
    suite builds hundreds."""
    with activate(mesh, rules):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
    return graphdef


class Learner:
    """One model under training (see the module docstring). ``module`` gives the architecture
    (its class and config) and the starting weights; ``lr`` is the schedule's peak; ``remat``
    the decoder layers' remat policy (default ``train.remat``, ``none`` where that is ``auto``).

    ``abstract=True`` allocates nothing: params and optimizer state are ``jax.ShapeDtypeStruct``
    leaves on their shardings, enough to lower and compile the steps and read their memory
    (``trainer/memory.py``), for a model too large to hold here or before deciding how to run it.
    A module made by ``nnx.eval_shape`` gives an abstract learner whatever the flag says."""

    def __init__(self, module: nnx.Module, *, train: TrainConfig, lr: float, mesh: Mesh, rules: Rules,
                 loss: LossFn, forward: ForwardFn, remat: str | None = None, abstract: bool = False) -> None:
        self.train, self.mesh, self.rules = train, mesh, rules
        self.step = 0
        """Optimizer steps taken (skipped ones not counted); the schedule's position."""
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.data_sharding = logical_to_sharding(("batch", "length"), mesh, rules)
        self.source_graphdef, state = nnx.split(module)
        self.module_type, self.config = type(module), module.config
        self.compute_dtype = train.resolved_compute_dtype()
        self.shardings = ps = shardings_of(state, mesh, rules)
        self.abstract = abstract or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
        self.params = abstract_params(state, ps) if self.abstract else place(state, ps)
        self._lr = lr
        self.schedule = dataclasses.replace(train, lr=lr).schedule()
        self.tx = adamw(train, self.schedule)
        self.opt_shardings = os_ = opt_state_shardings(self.tx, self.params, ps, self.replicated)
        if self.abstract:
            self.opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                          jax.eval_shape(self.tx.init, self.params), os_)
        else:
            with activate(mesh, rules):
                self.opt_state = jax.jit(self.tx.init, out_shardings=os_)(self.params)
        self._loss, self._forward = loss, forward
        self.use_remat(remat or ("none" if train.remat == "auto" else train.remat))
        self._lent = False

    def use_remat(self, policy: str) -> None:
        """Run the decoder layers under remat ``policy`` (``none``, ``dots``, ``full``) from now on:
        the step functions are rebuilt (and compile again on their next call)."""
        self.remat = remat_policy(policy, "remat")
        self.graphdef = self._compute_graphdef(self.module_type, self.config)
        self._cast = compute_cast_mask(self.graphdef, self.params, self.compute_dtype)
        steps = shared_steps(self.graphdef, self._loss, self._forward, self.tx, self.schedule,
                             dataclasses.replace(self.train, lr=self._lr), self.mesh, self.rules,
                             self.shardings, self.opt_shardings, self.data_sharding)
        self.grad_fn, self.forward_fn, self.apply_fn, self._apply_keep_fn, self._zeros_fn = steps
        self._keep_compiled: Future | None = None
        self._apply_compiled: Future | None = None

    def _compute_graphdef(self, cls: type[nnx.Module], config: Any) -> nnx.GraphDef:
        """The graph the jitted code merges params into. It differs from the source model's only
        in numerics: float32 storage (the master copy), the configured compute dtype and remat."""
        cfg = config.replace(param_dtype="float32", dtype=self.compute_dtype, remat=self.remat)
        try:
            return _abstract_graphdef(cls, cfg, self.mesh, self.rules)
        except TypeError:  # an unhashable config or rules (a list inside): built, not looked up
            return _abstract_graphdef.__wrapped__(cls, cfg, self.mesh, self.rules)

    def compute_params(self, params: nnx.State) -> nnx.State:
        """``params`` as the model computes with them: every weight its layer casts to the compute
        dtype, cast (on its own shard); the rest as it is. A frozen copy in these dtypes gives
        the same outputs as the float32 one at half its memory in bfloat16.

        The steps themselves take the float32 masters: XLA's partitioner already puts each
        layer's cast on the shard, before the FSDP gather (so the gather moves bfloat16,
        ``tests/trainer/test_scale.py``), and casting the whole model up front would hold a
        second, bfloat16 copy of every layer's shard through the step (1.5 GiB per device at
        Qwen2.5-7B on 8 devices)."""
        def cast(x: jax.Array, s: NamedSharding, yes: bool) -> jax.Array:
            if not yes or x.dtype == self.compute_dtype:
                return x
            return jax.lax.with_sharding_constraint(x.astype(self.compute_dtype), s)

        # ``shardings`` and the mask have one leaf per variable: a prefix of ``params``.
        return jax.tree.map(lambda s, yes, var: jax.tree.map(lambda x: cast(x, s, yes), var),
                            self.shardings, self._cast, params)

    # --- calls --------------------------------------------------------------------------------

    def zeros(self) -> nnx.State:
        """A zero gradient accumulator, sharded like the params."""
        with activate(self.mesh, self.rules):
            return self._zeros_fn(self.params)

    def grad(self, acc: nnx.State, batch: dict[str, Any], scalars: dict[str, Any]) -> tuple[nnx.State, dict]:
        """``acc`` (donated) plus this micro-batch's gradient, and its statistics (device arrays)."""
        scalars = put_from_host(scalars, self.replicated)  # explicitly: the batch itself is already there
        with activate(self.mesh, self.rules):
            return self.grad_fn(self.params, acc, batch, scalars)

    def forward(self, batch: dict[str, Any], params: nnx.State | None = None) -> jax.Array:
        """Per-position outputs of ``params`` (the current ones by default) on one micro-batch."""
        with activate(self.mesh, self.rules):
            return self.forward_fn(self.params if params is None else params, batch)

    def apply(self, grads: nnx.State, step: int | None = None) -> dict[str, jax.Array]:
        """One optimizer step with the accumulated ``grads`` at schedule position ``step`` (the
        learner's own by default). Returns its device stats; ``step`` moves on by one here, and
        back by one per skipped step once the caller has read ``skipped`` (``count_skipped``)."""
        fn = self.apply_fn
        if self._apply_compiled is not None and self._apply_compiled.exception() is None:
            fn = self._apply_compiled.result()  # compiled ahead (``compile_update``); else it compiles here
        if self._lent:
            fn = self._apply_keep_fn if self._keep_compiled is None else self._keep_compiled.result()
        position = put_from_host(np.int32(self.step if step is None else step), self.replicated)
        with activate(self.mesh, self.rules):
            self.params, self.opt_state, out = fn(self.params, self.opt_state, grads, position)
        self._lent = False  # the new params are the learner's alone
        self.step += 1
        return out

    def count_skipped(self, skipped: int) -> None:
        """Steps ``apply`` counted that the device skipped (non-finite gradients) leave the
        optimizer's own count where it was: the schedule position follows."""
        self.step -= skipped

    def module(self) -> nnx.Module:
        """The current model in the source module's numerics; shares the learner's buffers, so read
        it before the next ``apply`` (which donates them) or keep it only through ``lend``."""
        return nnx.merge(self.source_graphdef, self.params)

    def lend(self) -> nnx.State:
        """The current float32 params themselves (no copy), for a reader that keeps them past the
        next update; that update writes new buffers instead of donating these."""
        self._lent = True
        self.compile_lent_update()
        return self.params

    def compile_lent_update(self) -> None:
        """Compile the update that keeps lent params (``lend``) in a background thread, once:
        the ``apply`` after a lend needs it, and it would otherwise compile inside that step
        (seconds on a CPU, mid-run, with ``train.compile_warmup`` off). ``lend`` starts it at the
        latest; an RL run starts it when the trainer is built, so that it overlaps the servers'
        start and the first batch's generation."""
        if self._keep_compiled is None and not self.abstract:
            self._keep_compiled = self._compile_in_background(self._apply_keep_fn, "compile-apply-keep")

    def compile_update(self) -> None:
        """Compile ``apply`` (the optimizer step of params this learner alone holds) in a
        background thread, once: an RL run starts it before its first batch is generated, so
        that step 1 does not compile it (``Trainer.compile_first_step``)."""
        if self._apply_compiled is None and not self.abstract:
            self._apply_compiled = self._compile_in_background(self.apply_fn, "compile-apply")

    def compiled_update(self) -> None:
        """Wait for ``compile_update``'s executable (raising its error), if it was started."""
        if self._apply_compiled is not None:
            self._apply_compiled.result()

    def _compile_in_background(self, fn: Any, name: str) -> Future:
        """``fn`` (an optimizer step) compiled for this learner's params in a thread: a future of
        the executable, or of the error, which the step then raises where it would have compiled."""
        abstract = lambda tree: jax.tree.map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        args = (abstract(self.params), abstract(self.opt_state), abstract(self.params),
                jax.ShapeDtypeStruct((), np.int32, sharding=self.replicated))
        done: Future = Future()
        mesh, rules = self.mesh, self.rules

        def compile_() -> None:
            try:
                with activate(mesh, rules):
                    done.set_result(fn.lower(*args).compile())
            except BaseException as e:
                done.set_exception(e)

        threading.Thread(target=compile_, name=name, daemon=True).start()
        return done

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves: the params and the optimizer state (the learner's own buffers)."""
        return {"params": self.params, "opt_state": self.opt_state}

    def load(self, params: nnx.State, opt_state: Any, step: int) -> None:
        """Take over restored ``params`` and ``opt_state`` (on this learner's shardings) at ``step``."""
        self.params, self.opt_state, self.step = params, opt_state, step
        self._lent = False

    def copy_params(self) -> nnx.State:
        """A frozen copy of the current params on the same shardings (a reference model), in
        the compute dtype where the model computes in it (``compute_params``): half the memory
        of a float32 copy in bfloat16, and the same logprobs."""
        if self.abstract:
            return jax.tree.map(
                lambda s, yes, var: jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    x.shape, self.compute_dtype if yes else x.dtype, sharding=s), var),
                self.shardings, self._cast, self.params)
        with activate(self.mesh, self.rules):
            return jax.jit(lambda p: jax.tree.map(jnp.copy, self.compute_params(p)),
                           out_shardings=self.shardings)(self.params)

    def place_frozen(self, module: nnx.Module) -> nnx.State:
        """``module``'s params (the same architecture) placed like this learner's, in the dtypes
        of ``copy_params``: a given reference model."""
        dtypes = jax.tree.map(lambda yes: jnp.dtype(self.compute_dtype) if yes else jnp.float32, self._cast)
        return place(nnx.split(module)[1], self.shardings, dtypes)
