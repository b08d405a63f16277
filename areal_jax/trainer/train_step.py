"""The decoupled-PPO train step: ``Trainer.train_batch(trajectories, version) -> stats``.

One training batch becomes ``AlgoConfig.ppo_n_minibatches`` optimizer steps. Before any update
the batch is packed (see ``trainer/batching.py``), the proximal logprobs are recomputed with the
pre-update weights on exactly those micro-batches (or approximated from versions inside the
loss), reference logprobs feed a KL reward penalty when ``kl_coef > 0``, and advantages are
computed group-wise. Each minibatch then accumulates gradients over its micro-batches and takes
one AdamW step. A step whose loss or gradient holds a NaN or inf is skipped inside the jitted
apply (params and optimizer state stay as they were) and counted in the ``skipped_steps`` stat.

PPO with a critic (``adv_estimator='gae'``) is the same step with one option switched on: the
trainer also holds a ``Critic`` with its own AdamW. Before any update the critic scores the same
micro-batches (old values), GAE turns per-token rewards and those values into advantages and
returns, and every minibatch also takes a critic step on the clipped value loss.

Everything on device runs in ``jax.jit`` over split NNX state with explicit shardings: per model
one grad function (one compiled shape per length bucket), one forward function (logprobs or
values) and one apply function. Single-process for now: host arrays are placed with
``jax.device_put``.

Donation: the apply step donates the params and optimizer state it replaces, so an update never
holds two copies. The trainer therefore owns its params outright: it copies the model it is given
(the caller's arrays, which an engine may be serving, are never donated), and params handed out
with ``lend_params`` (to an in-process engine, with no copy) are not donated by the next update,
which writes new buffers instead; the engine frees the old ones when it lets go of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from areal_jax.algo import AlgoConfig, compute_advantages, explained_variance
from areal_jax.algo.kl import KL_ESTIMATORS
from areal_jax.data.packing import bucket_length
from areal_jax.data.trajectory import Trajectory
from areal_jax.models import Critic, Decoder
from areal_jax.trainer import batching
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.loss import micro_batch_loss, micro_batch_value_loss, token_logprobs, token_values
from sharding import DEFAULT_RULES, MeshConfig, activate, logical_to_sharding, make_mesh, shardings_of
from sharding.rules import Rules

_MAX_STATS = ("behavior_imp_weight_max",)
_FORWARD_KEYS = ("input_ids", "positions", "segment_ids")
_CRITIC_KEYS = (*_FORWARD_KEYS, "loss_mask", "old_values", "returns")


@dataclass
class MicroBatch:
    plan: batching.MicroBatchPlan
    arrays: dict[str, Any]
    """``[rows, length]`` fields; ``proximal_logprobs`` and ``old_values`` are device arrays."""


@dataclass
class PreparedBatch:
    """A training batch after the pre-update half of the step: packed, scored, with advantages."""

    trajectories: list[Trajectory]
    version: int
    minibatches: list[list[MicroBatch]]
    advantages: list[np.ndarray]
    """Per trajectory, index-``i`` convention (0 off the loss mask)."""
    stats: dict[str, float] = field(default_factory=dict)
    values: list[np.ndarray] | None = None
    """With a critic: its pre-update value of each token, index-``i`` convention (0 off the mask)."""
    returns: list[np.ndarray] | None = None
    """With a critic: the GAE returns the value loss regresses on, index-``i`` convention."""


_DECAYED = ("kernel", "embedding")


def _decayed(params: Any) -> Any:
    """Weight decay applies to matrices (kernels, embeddings), never to norms or biases. Decided by
    name, not rank: stacked layers give a norm scale a leading ``layers`` axis."""
    def leaf_name(path: tuple[Any, ...]) -> str:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        keys = [k for k in keys if k not in ("value", "raw_value")]  # a Variable's own leaf
        return keys[-1] if keys else ""

    return jax.tree_util.tree_map_with_path(lambda path, _: leaf_name(path) in _DECAYED, params)


class Trainer:
    """Holds the policy's float32 master params, the AdamW state, if ``kl_coef > 0`` a frozen
    reference, and if ``adv_estimator == 'gae'`` a critic with its own AdamW state; runs
    decoupled-PPO training batches on a mesh.

    The critic is ``critic`` when given, else ``Critic.from_policy(model)``: a copy of the policy's
    trunk with a fresh value head.
    """

    def __init__(
        self,
        model: Decoder,
        algo: AlgoConfig,
        train: TrainConfig | None = None,
        *,
        mesh: Mesh | None = None,
        rules: Rules = DEFAULT_RULES,
        reference: Decoder | None = None,
        critic: Critic | None = None,
    ) -> None:
        self.algo, self.train = algo, train or TrainConfig()
        self.mesh = mesh if mesh is not None else make_mesh(MeshConfig(), devices=jax.devices()[:1])
        self.rules = rules
        self.dp_groups = int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        self.step = 0
        self.skipped_steps = 0
        """Optimizer steps skipped so far because their gradient was not finite (see ``_apply_step``)."""
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.data_sharding = logical_to_sharding(("batch", "length"), self.mesh, rules)
        ds, rep = self.data_sharding, self.replicated
        self._source_graphdef, state = nnx.split(model)
        self.graphdef = self._compute_graphdef(Decoder, model.config)
        self.param_shardings = self._shardings(state)
        self.params = self._place(state, self.param_shardings)
        # kl_coef == 0 keeps no reference at all: no memory, no forward pass.
        self.ref_params = None
        if algo.kl_coef > 0:
            self.ref_params = self._place(nnx.split(reference)[1], self.param_shardings) if reference is not None \
                else jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)(self.params)

        self.schedule = self.train.schedule()
        self.tx = self._adamw(self.schedule)
        self.opt_shardings = self._opt_state_shardings(self.tx, self.params, self.param_shardings)
        ps, os_ = self.param_shardings, self.opt_shardings
        with activate(self.mesh, rules):
            self.opt_state = jax.jit(self.tx.init, out_shardings=os_)(self.params)
        # Advantages run on small [batch, width] arrays; width is bucketed so this compiles rarely.
        self._adv_fn = jax.jit(compute_advantages, static_argnums=0, static_argnames=("group_size",))
        self._ev_fn = jax.jit(explained_variance)
        self._zeros_fn = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=ps)
        self._grad_fn = jax.jit(self._grad_step, in_shardings=(ps, ps, ds, rep), out_shardings=(ps, rep),
                                donate_argnums=(1,))
        self._logprob_fn = jax.jit(self._logprob_step, in_shardings=(ps, ds), out_shardings=ds)
        self._apply_fn = jax.jit(partial(self._apply_step, self.tx), in_shardings=(ps, os_, ps),
                                 out_shardings=(ps, os_, rep), donate_argnums=(0, 1))
        # The same step for lent params: they stay alive (and unchanged) for whoever reads them.
        self._apply_keep_fn = jax.jit(partial(self._apply_step, self.tx), in_shardings=(ps, os_, ps),
                                      out_shardings=(ps, os_, rep), donate_argnums=(1,))
        self._lent = False
        # Critic-free estimators keep no critic at all: no memory, no forward or backward pass.
        self.critic_params = None
        if algo.adv_estimator == "gae":
            self._init_critic(critic if critic is not None else Critic.from_policy(model, nnx.Rngs(0)))

    def _init_critic(self, critic: Critic) -> None:
        """The critic's counterpart of everything above: compute graph, placed float32 params,
        its own AdamW (peak ``critic_lr``) and jitted grad, value and apply functions."""
        self._critic_source_graphdef, state = nnx.split(critic)
        self.critic_graphdef = self._compute_graphdef(Critic, critic.config)
        self.critic_shardings = cs = self._shardings(state)
        self.critic_params = self._place(state, cs)
        lr = self.train.lr if self.train.critic_lr is None else self.train.critic_lr
        self.critic_schedule = dataclasses.replace(self.train, lr=lr).schedule()
        self.critic_tx = self._adamw(self.critic_schedule)
        self.critic_opt_shardings = cos = self._opt_state_shardings(self.critic_tx, self.critic_params, cs)
        ds, rep = self.data_sharding, self.replicated
        with activate(self.mesh, self.rules):
            self.critic_opt_state = jax.jit(self.critic_tx.init, out_shardings=cos)(self.critic_params)
        self._critic_zeros_fn = jax.jit(lambda p: jax.tree.map(jnp.zeros_like, p), out_shardings=cs)
        self._critic_grad_fn = jax.jit(self._critic_grad_step, in_shardings=(cs, cs, ds, rep),
                                       out_shardings=(cs, rep), donate_argnums=(1,))
        self._value_fn = jax.jit(self._value_step, in_shardings=(cs, ds), out_shardings=ds)
        self._critic_apply_fn = jax.jit(partial(self._apply_step, self.critic_tx), in_shardings=(cs, cos, cs),
                                        out_shardings=(cs, cos, rep), donate_argnums=(0, 1))

    # --- jitted bodies ------------------------------------------------------------------------

    def _compute_graphdef(self, cls: type[nnx.Module], config: Any) -> nnx.GraphDef:
        """The graph the jitted code merges params into. It differs from the source model's only
        in numerics: float32 storage (the master copy), the configured compute dtype and remat."""
        cfg = config.replace(param_dtype="float32", dtype=self.train.resolved_compute_dtype(), remat=self.train.remat)
        with activate(self.mesh, self.rules):
            graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
        return graphdef

    def _shardings(self, state: nnx.State) -> Any:
        return shardings_of(state, self.mesh, self.rules)

    @staticmethod
    def _place(state: nnx.State, shardings: Any) -> nnx.State:
        """Float32 copies of ``state`` on ``shardings``: never the caller's own buffers (the apply
        step donates these), one leaf at a time so the transient is one tensor."""
        copy = lambda x, s: jax.device_put(jnp.asarray(x, jnp.float32), s, may_alias=False)
        # ``shardings`` has one leaf per variable: a prefix of ``state``.
        return jax.tree.map(lambda s, var: jax.tree.map(lambda x: copy(x, s), var), shardings, state)

    def _adamw(self, schedule: optax.Schedule) -> optax.GradientTransformation:
        t = self.train
        return optax.chain(
            optax.clip_by_global_norm(t.grad_clip) if t.grad_clip else optax.identity(),
            optax.adamw(schedule, b1=t.betas[0], b2=t.betas[1], eps=t.eps, weight_decay=t.weight_decay,
                        mask=_decayed),
        )

    def _opt_state_shardings(self, tx: optax.GradientTransformation, params: nnx.State, shardings: Any) -> Any:
        """Moment buffers are sharded like their parameter, scalars (step count) replicated.

        An optimizer-state leaf belongs to the parameter whose tree path ends its own path
        (``...mu['layers'][0]['mlp']...`` ends with the param's path); jit alone would leave
        the freshly made zeros on one device.
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
            return by_path[max(hits, key=len)] if hits else self.replicated

        return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(tx.init, params))

    def _grad_step(self, params: nnx.State, acc: nnx.State, batch: dict, scalars: dict) -> tuple[nnx.State, dict]:
        def loss_fn(p: nnx.State) -> tuple[jax.Array, dict]:
            return micro_batch_loss(nnx.merge(self.graphdef, p), batch, scalars, algo=self.algo,
                                    temperature=self.train.temperature, chunk_size=self.train.logprob_chunk_size,
                                    attention_window=self.train.max_seq_len)

        (scaled, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        aux["scaled_loss"] = scaled
        # A non-finite loss poisons the accumulated gradient, so the apply step skips the update
        # even where masking kept the gradient itself finite.
        ok = jnp.isfinite(scaled)
        return jax.tree.map(lambda a, g: a + jnp.where(ok, g, jnp.nan), acc, grads), aux

    def _logprob_step(self, params: nnx.State, batch: dict) -> jax.Array:
        lp, _ = token_logprobs(nnx.merge(self.graphdef, params), batch, temperature=self.train.temperature,
                               chunk_size=self.train.logprob_chunk_size, attention_window=self.train.max_seq_len)
        return lp

    @staticmethod
    def _apply_step(tx: optax.GradientTransformation, params: nnx.State, opt_state: Any,
                    grads: nnx.State) -> tuple[nnx.State, Any, dict]:
        """One optimizer step, skipped on device when the gradient holds a NaN or inf (its norm
        is then non-finite): params and optimizer state (moments, step count) come back as they
        were, and ``skipped`` says so in the stats the step returns anyway (no extra sync)."""
        grad_norm = optax.tree.norm(grads)
        updates, new_state = tx.update(grads, opt_state, params)
        finite = jnp.isfinite(grad_norm)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        return (keep(optax.apply_updates(params, updates), params), keep(new_state, opt_state),
                {"grad_norm": grad_norm, "skipped": jnp.logical_not(finite).astype(jnp.int32)})

    def _critic_grad_step(self, params: nnx.State, acc: nnx.State, batch: dict,
                          scalars: dict) -> tuple[nnx.State, dict]:
        def loss_fn(p: nnx.State) -> tuple[jax.Array, dict]:
            return micro_batch_value_loss(nnx.merge(self.critic_graphdef, p), batch, scalars, algo=self.algo,
                                          attention_window=self.train.max_seq_len)

        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(jnp.add, acc, grads), aux

    def _value_step(self, params: nnx.State, batch: dict) -> jax.Array:
        return token_values(nnx.merge(self.critic_graphdef, params), batch, attention_window=self.train.max_seq_len)

    # --- public API ---------------------------------------------------------------------------

    def model(self) -> Decoder:
        """The current policy as a ``Decoder`` for the weight streamer. It shares buffers with the
        trainer, so read it before the next ``train_batch`` (which donates them), or hold on to
        it past that only through ``lend_params``."""
        return nnx.merge(self._source_graphdef, self.params)

    def lend_params(self) -> nnx.State:
        """The current float32 params themselves (no copy), for a reader that keeps them past the
        next update, such as an in-process engine. The next update does not donate them: it
        writes the new params to new buffers, and these stay valid until the reader drops them."""
        self._lent = True
        return self.params

    params_for_streaming = model

    def critic(self) -> Critic | None:
        """The current critic (None without one); shares buffers like ``model()``."""
        if self.critic_params is None:
            return None
        return nnx.merge(self._critic_source_graphdef, self.critic_params)

    def checkpoint_state(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: the policy's params and AdamW state, and with a critic its
        params and AdamW state. The trainer's own buffers: save them before the next update."""
        state = {"params": self.params, "opt_state": self.opt_state}
        if self.critic_params is not None:
            state.update(critic_params=self.critic_params, critic_opt_state=self.critic_opt_state)
        return state

    def load_checkpoint_state(self, state: dict[str, Any], step: int) -> None:
        """Take over ``state`` (the tree of ``checkpoint_state``, restored onto this trainer's
        shardings) and the optimizer step count ``step``."""
        if set(state) != set(self.checkpoint_state()):
            raise ValueError(f"checkpoint holds {sorted(state)}, this trainer {sorted(self.checkpoint_state())}: "
                             "was it saved with another algo.adv_estimator?")
        self.params, self.opt_state = state["params"], state["opt_state"]
        if self.critic_params is not None:
            self.critic_params, self.critic_opt_state = state["critic_params"], state["critic_opt_state"]
        self.step = step
        self._lent = False

    def compute_logprobs(self, trajectories: Sequence[Trajectory], *, reference: bool = False) -> list[np.ndarray]:
        """Logprobs of every token under the current (or reference) weights, index-``i`` convention
        (``out[i]`` is token ``i``'s, ``out[0] = 0``): the proximal recompute on its own."""
        trajectories = list(trajectories)
        seqs = [batching.shifted_fields(t) for t in trajectories]
        lengths = [len(t) for t in trajectories]
        plans = self._plan(lengths, range(len(trajectories)))
        mbs = [MicroBatch(p, batching.pack_rows(seqs, p)) for p in plans]
        params = self.ref_params if reference else self.params
        if params is None:
            raise ValueError("reference logprobs asked for, but kl_coef == 0 keeps no reference model")
        return self._unpacked_logprobs(mbs, params, lengths)

    def train_batch(self, trajectories: Sequence[Trajectory], version: int) -> dict[str, float]:
        """One training batch: ``ppo_n_minibatches`` optimizer steps. ``version`` is the policy
        version of the current weights (the proximal policy). Returns scalar statistics."""
        start = time.perf_counter()
        prepared = self.prepare_batch(trajectories, version)
        stats = self.train_prepared(prepared)
        elapsed = time.perf_counter() - start
        stats["time_s"] = elapsed
        stats["tokens_per_s"] = stats["real_tokens"] / elapsed
        return stats

    def prepare_batch(self, trajectories: Sequence[Trajectory], version: int) -> PreparedBatch:
        """Pack the batch, recompute proximal (and reference) logprobs with the current weights,
        score it with the critic if there is one, and compute advantages (and returns); nothing
        is updated."""
        trajectories = list(trajectories)
        n_mb = self.algo.ppo_n_minibatches
        if len(trajectories) < n_mb:
            raise ValueError(f"{len(trajectories)} trajectories cannot fill ppo_n_minibatches={n_mb}")
        seqs = [batching.shifted_fields(t) for t in trajectories]
        lengths = [len(t) for t in trajectories]
        minibatches = [
            [MicroBatch(p, batching.pack_rows(seqs, p)) for p in self._plan(lengths, idx)]
            for idx in np.array_split(np.arange(len(trajectories)), n_mb)
        ]
        micro = [m for mb in minibatches for m in mb]
        stats: dict[str, float] = {}
        if self.algo.use_decoupled_loss and self.algo.proximal_logprobs == "recompute":
            with activate(self.mesh, self.rules):
                for m in micro:
                    m.arrays["proximal_logprobs"] = self._logprob_fn(self.params, self._inputs(m))
        token_kl = None
        if self.ref_params is not None:
            ref = self._unpacked_logprobs(micro, self.ref_params, lengths)
            if "proximal_logprobs" in micro[0].arrays:
                policy = self._unpack_device(micro, "proximal_logprobs", lengths)
            else:
                policy = [t.behavior_logprobs for t in trajectories]
            est = KL_ESTIMATORS[self.algo.kl_estimator]
            token_kl = [np.asarray(est(p, r)) * t.loss_mask for p, r, t in zip(policy, ref, trajectories, strict=True)]
            stats["kl_ref_mean"] = float(sum(k.sum() for k in token_kl) / sum(t.loss_mask.sum() for t in trajectories))
        values = None
        if self.critic_params is not None:
            with activate(self.mesh, self.rules):
                for m in micro:
                    m.arrays["old_values"] = self._value_fn(self.critic_params, self._forward_inputs(m))
            # Position j's output is the value before token j + 1; unshifting puts it at index
            # j + 1, so values[i] is token i's value: the GAE convention (and 0 on the prompt).
            # The last position's output, the value after the whole answer, is what a truncated
            # answer bootstraps from.
            raw = self._unpack_device(micro, "old_values", lengths, unshift=False)
            values = [batching.unshift(v) * t.loss_mask for v, t in zip(raw, trajectories, strict=True)]
            last_values = [float(v[len(t) - 1]) for v, t in zip(raw, trajectories, strict=True)]
        advantages, returns, adv_stats = self._advantages(trajectories, token_kl, values,
                                                          last_values if values is not None else None)
        stats.update(adv_stats)
        per_token = {"advantages": advantages} if returns is None else {"advantages": advantages, "returns": returns}
        seqs = [{"input_ids": t.input_ids, **{k: batching.shift_token_values(v[i]) for k, v in per_token.items()}}
                for i, t in enumerate(trajectories)]
        for m in micro:
            packed = batching.pack_rows(seqs, m.plan)
            m.arrays.update({k: packed[k] for k in per_token})
        return PreparedBatch(trajectories, version, minibatches, advantages, stats, values, returns)

    def train_prepared(self, prepared: PreparedBatch) -> dict[str, float]:
        """The update half: per minibatch, accumulate gradients over its micro-batches, then step
        (the policy, and the critic on the same micro-batches when there is one)."""
        micro_aux, apply_aux, lrs, critic_aux, critic_apply = [], [], [], [], []
        for minibatch in prepared.minibatches:
            acc, aux = self.minibatch_grads([self._train_inputs(m) for m in minibatch], prepared.version)
            micro_aux.extend(aux)
            lrs.append(float(self.schedule(self.step)))
            apply = self._apply_keep_fn if self._lent else self._apply_fn
            with activate(self.mesh, self.rules):
                self.params, self.opt_state, out = apply(self.params, self.opt_state, acc)
            self._lent = False  # the new params are the trainer's alone
            apply_aux.append(out)
            if self.critic_params is not None:
                c_acc, c_aux = self.critic_minibatch_grads([{k: m.arrays[k] for k in _CRITIC_KEYS} for m in minibatch])
                critic_aux.extend(c_aux)
                with activate(self.mesh, self.rules):
                    self.critic_params, self.critic_opt_state, c_out = self._critic_apply_fn(
                        self.critic_params, self.critic_opt_state, c_acc)
                critic_apply.append(c_out)
            self.step += 1
        stats = self._reduce_stats(prepared, jax.device_get(micro_aux), jax.device_get(apply_aux), lrs)
        # Skipped steps (non-finite gradients) left the optimizer's step count where it was.
        self.step -= int(stats["skipped_steps"])
        self.skipped_steps += int(stats["skipped_steps"])
        if critic_aux:
            stats.update(self._reduce_critic_stats(jax.device_get(critic_aux), jax.device_get(critic_apply)))
            stats["critic_lr"] = float(self.critic_schedule(self.step - 1))
        return stats

    def minibatch_grads(self, micro_batches: Sequence[dict[str, Any]], version: int = 0) -> tuple[nnx.State, list]:
        """Gradient of one minibatch's loss, accumulated over its micro-batches (``[rows, length]``
        dicts as ``batching.pack_rows`` makes them, plus ``advantages`` and, when recomputed,
        ``proximal_logprobs``). Each micro-batch's loss is scaled by its share of the minibatch's
        normaliser, so the sum is the gradient of the minibatch's loss however it was split.
        Returns the gradients and each micro-batch's statistics (device arrays)."""
        if self.algo.loss_aggregation == "constant":
            # Each micro-batch's loss is its token sum over the one constant: the shares add up to
            # the minibatch's sum / constant as they are, however the minibatch was packed.
            scales = [1.0] * len(micro_batches)
        else:
            units = [self._loss_units(m) for m in micro_batches]
            total = sum(units)
            scales = [1.0 if total == 0 else u / total for u in units]
        auxes = []
        with activate(self.mesh, self.rules):
            acc = self._zeros_fn(self.params)
            for m, scale in zip(micro_batches, scales, strict=True):
                scalars = {"loss_scale": np.float32(scale),
                           "proximal_version": np.float32(version)}
                acc, aux = self._grad_fn(self.params, acc, m, scalars)
                auxes.append(aux)
        return acc, auxes

    def critic_minibatch_grads(self, micro_batches: Sequence[dict[str, Any]]) -> tuple[nnx.State, list]:
        """The critic's counterpart of ``minibatch_grads``: the gradient of ``value_coef`` times the
        minibatch's value loss (a token mean), accumulated over micro-batches that hold
        ``input_ids``, ``positions``, ``segment_ids``, ``loss_mask``, ``old_values`` and
        ``returns`` in the position convention. Returns the gradients and per-micro-batch stats."""
        if self.critic_params is None:
            raise ValueError(f"adv_estimator={self.algo.adv_estimator!r} keeps no critic")
        counts = [float((np.asarray(m["loss_mask"]) > 0).sum()) for m in micro_batches]
        total = sum(counts)
        auxes = []
        with activate(self.mesh, self.rules):
            acc = self._critic_zeros_fn(self.critic_params)
            for m, c in zip(micro_batches, counts, strict=True):
                scalars = {"loss_scale": np.float32(1.0 if total == 0 else c / total)}
                acc, aux = self._critic_grad_fn(self.critic_params, acc, m, scalars)
                auxes.append(aux)
        return acc, auxes

    # --- helpers ------------------------------------------------------------------------------

    def _plan(self, lengths: Sequence[int], indices: Sequence[int]) -> list[batching.MicroBatchPlan]:
        t = self.train
        if t.max_seq_len is not None and max(lengths, default=0) > t.max_seq_len:
            longest = max(range(len(lengths)), key=lambda i: lengths[i])
            raise ValueError(f"trajectory {longest} has {lengths[longest]} tokens, more than "
                             f"TrainConfig.max_seq_len={t.max_seq_len}; raise max_seq_len or cap generation")
        return batching.plan_micro_batches(
            lengths, indices, dp_groups=self.dp_groups, token_budget=t.micro_batch_tokens,
            min_micro_batches=t.min_micro_batches, buckets=t.length_buckets)

    @staticmethod
    def _inputs(m: MicroBatch) -> dict[str, Any]:
        return {k: m.arrays[k] for k in ("input_ids", "targets", "positions", "segment_ids")}

    @staticmethod
    def _forward_inputs(m: MicroBatch) -> dict[str, Any]:
        return {k: m.arrays[k] for k in _FORWARD_KEYS}

    def _train_inputs(self, m: MicroBatch) -> dict[str, Any]:
        keys = ["input_ids", "targets", "positions", "segment_ids", "loss_mask", "behavior_logprobs", "versions",
                "advantages"]
        if "proximal_logprobs" in m.arrays:
            keys.append("proximal_logprobs")
        return {k: m.arrays[k] for k in keys}

    def _loss_units(self, arrays: dict[str, Any]) -> float:
        """What the loss aggregation divides by, counted in this micro-batch."""
        mask = arrays["loss_mask"] > 0
        if self.algo.loss_aggregation == "seq_mean_token_mean":
            ids = np.where(mask, arrays["segment_ids"] + np.arange(mask.shape[0])[:, None] * mask.shape[1], -1)
            return float(len(np.unique(ids[ids >= 0])))
        return float(mask.sum())

    def _unpacked_logprobs(self, micro: list[MicroBatch], params: nnx.State,
                           lengths: Sequence[int]) -> list[np.ndarray]:
        with activate(self.mesh, self.rules):
            outs = [self._logprob_fn(params, self._inputs(m)) for m in micro]
        return self._unpack(micro, jax.device_get(outs), lengths)

    def _unpack_device(self, micro: list[MicroBatch], key: str, lengths: Sequence[int],
                       unshift: bool = True) -> list[np.ndarray]:
        return self._unpack(micro, jax.device_get([m.arrays[key] for m in micro]), lengths, unshift)

    @staticmethod
    def _unpack(micro: list[MicroBatch], values: list[np.ndarray], lengths: Sequence[int],
                unshift: bool = True) -> list[np.ndarray]:
        per: dict[int, np.ndarray] = {}
        for m, v in zip(micro, values, strict=True):
            per.update(batching.unpack_rows(v, m.plan, lengths))
        return [batching.unshift(per[i]) if unshift else per[i] for i in range(len(lengths))]

    def _advantages(
        self, trajectories: list[Trajectory], token_kl: list[np.ndarray] | None,
        values: list[np.ndarray] | None = None, last_values: list[float] | None = None,
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None, dict[str, float]]:
        """Advantages, returns (None without a critic) and their stats, index-``i`` convention.
        Groups are gathered by ``group_id``; ``values`` are the critic's, GAE's input, and
        ``last_values`` its value after each whole answer, which truncated answers bootstrap from."""
        order = sorted(range(len(trajectories)), key=lambda i: (trajectories[i].group_id, i))
        sizes: dict[int, int] = {}
        for t in trajectories:
            sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
        group_size = next(iter(sizes.values()))
        if len(set(sizes.values())) > 1 and self.algo.adv_estimator not in ("reinforce_pp", "gae"):
            raise ValueError(f"groups must all have the same size for adv_estimator={self.algo.adv_estimator!r}; "
                             f"got sizes by group_id {sizes}")
        width = bucket_length(max(len(t) for t in trajectories), self.train.length_buckets)
        pad = lambda x: np.pad(x, (0, width - len(x)))
        mask = np.stack([pad(trajectories[i].loss_mask) for i in order])
        rewards = np.array([trajectories[i].reward for i in order], np.float32)
        kl = None if token_kl is None else np.stack([pad(token_kl[i]) for i in order])
        lengths = np.array([trajectories[i].answer_len for i in order], np.float32)
        vals = None if values is None else np.stack([pad(values[i]) for i in order])
        boot = {}
        if last_values is not None:
            boot = {"truncated": np.array([trajectories[i].truncated for i in order]),
                    "last_values": np.array([last_values[i] for i in order], np.float32)}
        adv, ret = self._adv_fn(self.algo, rewards, mask, group_size=group_size, token_kl=kl,
                                response_lengths=lengths, values=vals, **boot)
        stats: dict[str, float] = {}
        if ret is not None:
            count = max(float(mask.sum()), 1.0)
            stats["explained_variance"] = float(self._ev_fn(vals, ret, mask))
            stats["value_mean"] = float((vals * mask).sum() / count)
            stats["return_mean"] = float((np.asarray(ret) * mask).sum() / count)

        def unpad(x: jax.Array | None) -> list[np.ndarray] | None:
            if x is None:
                return None
            x = np.asarray(x)
            out: list[np.ndarray] = [np.zeros(0)] * len(trajectories)
            for row, i in enumerate(order):
                out[i] = x[row, : len(trajectories[i])].astype(np.float32)
            return out

        return unpad(adv), unpad(ret), stats

    @staticmethod
    def _reduce_critic_stats(micro: list[dict], applied: list[dict]) -> dict[str, float]:
        counts = np.array([a["mask_count"] for a in micro], np.float64)
        total = max(counts.sum(), 1.0)
        stats = {k: float((np.array([a[k] for a in micro], np.float64) * counts).sum() / total)
                 for k in ("value_loss", "value_clip_fraction")}
        stats["critic_skipped_steps"] = float(sum(int(a["skipped"]) for a in applied))
        norms = [float(a["grad_norm"]) for a in applied if not a["skipped"]] or [float("nan")]
        stats["critic_grad_norm"] = float(np.mean(norms))
        return stats

    def _reduce_stats(self, prepared: PreparedBatch, micro: list[dict], applied: list[dict],
                      lrs: list[float]) -> dict[str, float]:
        counts = np.array([a["mask_count"] for a in micro], np.float64)
        total = max(counts.sum(), 1.0)
        stats: dict[str, float] = dict(prepared.stats)
        for key in micro[0]:
            if key in ("mask_count", "entropy_sum", "scaled_loss", "loss"):
                continue
            vals = np.array([a[key] for a in micro], np.float64)
            stats[key] = float(vals.max() if key in _MAX_STATS else (vals * counts).sum() / total)
        per_mb = np.split(np.array([a["scaled_loss"] for a in micro]),
                          np.cumsum([len(mb) for mb in prepared.minibatches])[:-1])
        stats["loss"] = float(np.mean([s.sum() for s in per_mb]))
        stats["entropy"] = float(sum(a["entropy_sum"] for a in micro) / total)
        stats["skipped_steps"] = float(sum(int(a["skipped"]) for a in applied))
        norms = [float(a["grad_norm"]) for a in applied if not a["skipped"]] or [float("nan")]
        stats["grad_norm"] = float(np.mean(norms))
        stats["grad_norm_max"] = float(np.max(norms))
        stats["lr"] = lrs[-1]
        trajs = prepared.trajectories
        lengths = [len(t) for t in trajs]
        plans = [m.plan for mb in prepared.minibatches for m in mb]
        real = sum(lengths)
        stats["real_tokens"] = float(real)
        stats["loss_tokens"] = float(total)
        stats["n_micro_batches"] = float(len(plans))
        stats["padding_efficiency"] = real / sum(len(p.rows) * p.length for p in plans)
        stats["reward_mean"] = float(np.mean([t.reward for t in trajs]))
        staleness = [t.staleness(prepared.version) for t in trajs]
        stats["staleness_max"] = float(max(staleness))
        stats["staleness_mean"] = float(np.mean(staleness))
        stats["step"] = float(self.step)
        return stats
