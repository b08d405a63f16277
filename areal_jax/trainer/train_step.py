"""The decoupled-PPO train step: ``Trainer.train_batch(trajectories, version) -> stats``.

One training batch becomes ``AlgoConfig.ppo_n_minibatches`` optimizer steps. The pre-update half
(``trainer/prepare.py``) packs the batch into micro-batches on the mesh, recomputes the proximal
logprobs with the pre-update weights on exactly those micro-batches (or leaves them to be
approximated from versions inside the loss), takes reference logprobs for a KL reward penalty
when ``kl_coef > 0``, and computes advantages group-wise. Each minibatch then accumulates
gradients over its micro-batches and takes one AdamW step; a step whose loss or gradient holds a
NaN or inf is skipped on device and counted in ``skipped_steps``. ``trainer/stats.py`` turns
what the device reports into the step's statistics.

PPO with a critic (``adv_estimator='gae'``) is the same step with one option switched on: the
critic is a second ``Learner`` (``trainer/learner.py``) with its own AdamW. It scores the same
micro-batches before any update (old values), GAE turns per-token rewards and those values into
advantages and returns, and every minibatch also takes a critic step on the clipped value loss.

Multi-host: every process runs the same calls on the same batch; each places only the rows its
devices hold (see ``trainer/prepare.py``) and reads back replicated statistics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from areal_jax.algo import AlgoConfig, proximal
from areal_jax.data.packing import bucket_length, build_packed_batch
from areal_jax.data.trajectory import Trajectory
from areal_jax.models import Critic, Decoder
from areal_jax.models.attention import resolve_attention_impl
from areal_jax.models.config import ModelConfig
from areal_jax.trainer import batching
from areal_jax.trainer import stats as step_stats
from areal_jax.trainer.compile_clock import compile_clock
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.learner import Learner
from areal_jax.trainer.loss import micro_batch_loss, micro_batch_value_loss, token_logprobs, token_values
from areal_jax.trainer.memory import (
    REMAT_ORDER,
    MemoryPlan,
    device_bytes,
    device_capacity,
    device_limit,
    engine_memory,
    plan_remat,
)
from areal_jax.trainer.prepare import (
    CRITIC_KEYS,
    LOGPROB_KEYS,
    STEP_KEYS,
    BatchPreparer,
    MicroBatch,
    PreparedBatch,
    fetch,
    loss_units,
)
from sharding import DEFAULT_RULES, MeshConfig, activate, make_mesh
from sharding.rules import Rules

log = logging.getLogger(__name__)

__all__ = ["MicroBatch", "PreparedBatch", "Trainer"]

POLICY_SCALARS = {"loss_scale": np.float32(1.0), "proximal_version": np.float32(0.0), "own_proximal": np.float32(0.0)}
"""The scalars every policy gradient step takes (``minibatch_grads``), for lowering it abstractly."""


def abstract_critic(config: ModelConfig, mesh: Mesh, rules: Rules) -> Critic:
    """A critic for ``config`` with ``jax.ShapeDtypeStruct`` params: an abstract trainer's."""
    with activate(mesh, rules):
        return nnx.eval_shape(lambda: Critic(config, rngs=nnx.Rngs(0)))


class Trainer:
    """The policy's ``Learner`` (float32 master params and AdamW state), if ``kl_coef > 0`` a
    frozen reference, and if ``adv_estimator == 'gae'`` a critic ``Learner``; runs decoupled-PPO
    training batches on a mesh.

    The critic is ``critic`` when given, else ``Critic.from_policy(model)``: a copy of the policy's
    trunk with a fresh value head.

    The state lives in the learners: ``trainer.policy`` (``params``, ``opt_state``, ``step``,
    ``lend()``) and ``trainer.critic_learner`` (None without a critic); ``trainer.preparer`` is
    the pre-update half (``trainer/prepare.py``). The trainer runs the batch through them.
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
        engine: Any = None,
        engine_dtype: Any = None,
        engine_mesh: Mesh | None = None,
        engine_fused: bool = False,
    ) -> None:
        # ``micro_batch_tokens: auto`` becomes this backend's number here, as the trainer starts.
        self.algo, self.train = algo, (train or TrainConfig()).resolved()
        self.mesh = mesh if mesh is not None else make_mesh(MeshConfig(), devices=jax.devices()[:1])
        self.rules = rules
        self.model_config = model.config
        self.dp_groups = int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])
        self.skipped_steps = 0
        """Optimizer steps skipped so far because their gradient was not finite."""
        t = self.train
        attention = {"attention_window": t.max_seq_len, "attention_block": t.attention_block}
        make_policy = partial(
            Learner, model, train=t, lr=t.lr, mesh=self.mesh, rules=rules,
            loss=partial(micro_batch_loss, algo=algo, temperature=t.temperature, chunk_size=t.logprob_chunk_size,
                         **attention),
            forward=partial(token_logprobs_only, temperature=t.temperature, chunk_size=t.logprob_chunk_size,
                            **attention))
        # Planned on abstract arrays first: a model that cannot fit fails with the knobs to turn
        # before any of it is allocated.
        self.policy = make_policy(abstract=True)
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(model)))
        """Built from an ``nnx.eval_shape`` model: nothing allocated, only ``memory`` and lowering."""
        # Block pairs serve the dense attention path only: the fused kernels skip masked blocks themselves.
        dense = resolve_attention_impl(model.config.attention_impl, t.resolved_compute_dtype()) == "dense"
        self.preparer = BatchPreparer(algo, t, dp_groups=self.dp_groups, data_sharding=self.policy.data_sharding,
                                      pairs_block=t.attention_block if dense else 0)
        make_critic = None
        if algo.adv_estimator == "gae":
            if critic is None:
                critic = abstract_critic(model.config, self.mesh, rules) if self.abstract else \
                    Critic.from_policy(model, nnx.Rngs(0))
            make_critic = partial(
                Learner, critic, train=t, lr=t.lr if t.critic_lr is None else t.critic_lr, mesh=self.mesh,
                rules=rules, loss=partial(micro_batch_value_loss, algo=algo, **attention),
                forward=partial(token_values, **attention))
        # An in-process engine on these devices (``rollout.backend: local``, shared placement):
        # its ``EngineConfig``, dtype and mesh (this mesh, or on several processes its host's
        # part; ``engine_fused``: its projections fused), planned beside the step.
        self.memory: MemoryPlan | None = self._plan_memory(
            make_critic, kl=algo.uses_reference, engine=engine, engine_dtype=engine_dtype,
            engine_mesh=engine_mesh, engine_fused=engine_fused)
        """The memory plan (None where no device memory is known and nothing was planned)."""
        if not self.abstract:
            self.policy = make_policy(remat=self.policy.remat)
        # Without a KL reward or loss term no reference is kept: no memory, no forward pass.
        self.ref_params = None
        if algo.uses_reference:
            self.ref_params = self.policy.copy_params() if reference is None else self.policy.place_frozen(reference)
        # Critic-free estimators keep no critic at all: no memory, no forward or backward pass.
        self.critic_learner: Learner | None = None
        if make_critic is not None:
            self.critic_learner = make_critic(remat=self.policy.remat, abstract=self.abstract)
        self._ahead: Future | None = None
        """``compile_first_step`` while it runs; the next ``train_batch`` waits for it."""

    def _plan_memory(self, make_critic: Any, kl: bool, engine: Any = None, engine_dtype: Any = None,
                     engine_mesh: Mesh | None = None, engine_fused: bool = False) -> MemoryPlan | None:
        """Choose the policy's remat by the memory plan (``trainer/memory.py``), with ``engine``
        (an ``EngineConfig``) beside it, or keep ``train.remat`` (``none`` for ``auto``) where no
        device memory is known."""
        t = self.train
        devices = list(self.mesh.devices.flat)
        capacity, source = device_capacity(t.device_memory_gb, devices)
        if capacity is None:
            return None
        beside = None
        if engine is not None:
            beside = engine_memory(self.model_config, engine, engine_mesh if engine_mesh is not None else self.mesh,
                                   dtype=engine_dtype, device_limit=device_limit(t.device_memory_gb, devices),
                                   fused=engine_fused)
        resident = device_bytes(self.policy.copy_params()) if kl else 0
        if make_critic is not None:  # its step runs apart, and needs less than the policy's (no logits)
            critic = make_critic(abstract=True)
            resident += device_bytes(critic.params) + device_bytes(critic.opt_state)
        knobs = (f" (now train.micro_batch_tokens={t.micro_batch_tokens}, mesh data={self.mesh.shape['data']} "
                 f"fsdp={self.mesh.shape['fsdp']} tensor={self.mesh.shape['tensor']}, train.remat={t.remat})")
        return plan_remat(self.policy, self.largest_micro_batch(), POLICY_SCALARS, capacity=capacity,
                          capacity_source=source, resident_bytes=resident, knobs=lambda: knobs,
                          policies=REMAT_ORDER if t.remat == "auto" else (t.remat,), engine=beside)

    def largest_micro_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The gradient step's largest input, abstract: one row per data-parallel group of the
        bucket that holds ``micro_batch_tokens``, with every field a real micro-batch carries
        (its dtypes read off a packed placeholder row) and the largest attention pair budget."""
        t = self.train
        length = bucket_length(t.micro_batch_tokens, t.length_buckets)
        row = build_packed_batch([batching.shifted_fields(Trajectory(
            input_ids=np.ones(2, np.int32), loss_mask=np.array([0, 1], np.float32),
            behavior_logprobs=np.zeros(2, np.float32), versions=np.array([-1, 0], np.int32), reward=0.0,
            group_id=0, prompt_len=1))], [0], length)
        extra = self.preparer.step_extra_keys
        dtypes = {k: v.dtype for k, v in row.items()} | dict.fromkeys(extra, np.dtype(np.float32))
        rows, ds = self.dp_groups, self.policy.data_sharding
        batch = {k: jax.ShapeDtypeStruct((rows, length), d, sharding=ds) for k, d in dtypes.items()
                 if k in STEP_KEYS}
        budgets = self.preparer.budget_ladder(length)
        if budgets:
            batch["attention_pairs"] = jax.ShapeDtypeStruct((rows, budgets[-1], 2), np.int32, sharding=ds)
        return batch

    # --- state: the learners hold it (``trainer.policy``, ``trainer.critic_learner``) ---------

    def model(self, params: nnx.State | None = None) -> Decoder:
        """The current policy as a ``Decoder`` for the weight streamer and export. It shares buffers
        with the trainer, so read it before the next ``train_batch`` (which donates them), or hold
        on to it past that only through ``policy.lend()``: ``params`` (what ``lend`` returned)
        builds the model on those instead."""
        return self.policy.module() if params is None else nnx.merge(self.policy.source_graphdef, params)

    def checkpoint_state(self) -> dict[str, Any]:
        """The arrays a checkpoint holds: the policy's params and AdamW state, and with a critic its
        params and AdamW state. The trainer's own buffers: save them before the next update."""
        state = self.policy.state()
        if self.critic_learner is not None:
            state.update({f"critic_{k}": v for k, v in self.critic_learner.state().items()})
        return state

    def load_checkpoint_state(self, state: dict[str, Any], step: int, critic_step: int | None = None) -> None:
        """Take over ``state`` (the tree of ``checkpoint_state``, restored onto this trainer's
        shardings) and the optimizer step counts: the policy's ``step`` and the critic's
        ``critic_step`` (``step`` when not given; they differ only where one skipped a step)."""
        if set(state) != set(self.checkpoint_state()):
            raise ValueError(f"checkpoint holds {sorted(state)}, this trainer {sorted(self.checkpoint_state())}: "
                             "was it saved with another algo.adv_estimator?")
        self.policy.load(state["params"], state["opt_state"], step)
        if self.critic_learner is not None:
            self.critic_learner.load(state["critic_params"], state["critic_opt_state"],
                                     step if critic_step is None else critic_step)

    # --- training -----------------------------------------------------------------------------

    def compute_logprobs(self, trajectories: Sequence[Trajectory], *, reference: bool = False) -> list[np.ndarray]:
        """Logprobs of every token under the current (or reference) weights, index-``i`` convention
        (``out[i]`` is token ``i``'s, ``out[0] = 0``): the proximal recompute on its own."""
        trajectories = list(trajectories)
        params = self.ref_params if reference else self.policy.params
        if params is None:
            raise ValueError("reference logprobs asked for, but with kl_coef and kl_loss_coef 0 there is no "
                             "reference model")
        micro = self.preparer.pack(trajectories, range(len(trajectories)))
        return self.preparer.logprobs(self.policy, micro, [len(t) for t in trajectories], params)

    def train_batch(self, trajectories: Sequence[Trajectory], version: int) -> dict[str, float]:
        """One training batch: ``ppo_n_minibatches`` optimizer steps. ``version`` is the policy
        version of the current weights (the proximal policy). Returns scalar statistics, among them
        ``compile_seconds``: the part of the step spent tracing and compiling new shapes."""
        start = time.perf_counter()
        waited = self._wait_ahead()
        with compile_clock() as compiling:
            prepared = self.prepare_batch(trajectories, version)
            stats = self.train_prepared(prepared)
        elapsed = time.perf_counter() - start
        stats["time_s"] = elapsed
        stats["compile_seconds"] = compiling.seconds
        stats["compile_ahead_wait_seconds"] = waited
        stats["tokens_per_s"] = stats["real_tokens"] / elapsed
        return stats

    def warmup(self, lengths: Sequence[int] | None = None) -> dict[str, float]:
        """Compile the policy's step shapes before the first batch, as a server's warm-up does:
        for each row length (default: the length buckets up to ``micro_batch_tokens``) and each
        attention pair budget a micro-batch of that length can take, the gradient and (where
        batches recompute proximal logprobs or score a reference) the forward, each run once on
        placeholder tokens that carry the fields a real micro-batch carries (nothing is applied).
        Without it a shape compiles the first time a batch needs it, in the middle of a run. The
        optimizer step and a critic's shapes are not warmed. Returns the shapes, the seconds, and
        the part of them spent compiling."""
        t = self.train
        lengths = [b for b in t.length_buckets if b <= t.micro_batch_tokens] if lengths is None else list(lengths)
        forward = proximal.recomputes(self.algo) or self.ref_params is not None
        start, shapes, last = time.perf_counter(), 0, None
        with compile_clock() as compiling:
            for length in lengths:
                for m in self.preparer.warmup_micro_batches(length):
                    out = self.policy.forward(m.inputs(LOGPROB_KEYS)) if forward else None
                    last = (out, self.minibatch_grads([m.inputs(STEP_KEYS)], units=[1.0]))
                    shapes += 1
            jax.block_until_ready(last)
        return {"shapes": shapes, "seconds": time.perf_counter() - start, "compile_seconds": compiling.seconds}

    def compile_first_step(self, lengths: Sequence[int], group_size: int) -> Future:
        """Compile, in a background thread, what a batch of trajectories of ``lengths`` (groups of
        ``group_size``, in order) runs: the packing's shapes, the advantages, the forward passes
        and gradients on placeholder tokens (nothing applied), and the optimizer steps (compiled
        ahead, ``Learner.compile_update``). An RL run calls it with the longest trajectories its
        first batch can hold while rollout generates that batch: a real batch whose micro-batches
        have the same row lengths then takes the attention pair budgets registered here (each the
        smallest already used that holds its pairs) and compiles nothing. The next
        ``train_batch`` waits for it first (the two would race for the same shapes). Returns its
        future: the shapes and seconds it took."""
        done: Future = Future()

        def run() -> None:
            start = time.perf_counter()
            try:
                self.policy.compile_update()
                if self.critic_learner is not None:
                    self.critic_learner.compile_update()
                with compile_clock() as compiling:
                    trajectories = [Trajectory(input_ids=np.full(n, 1, np.int32), loss_mask=np.r_[0.0, np.ones(n - 1)],
                                               behavior_logprobs=np.zeros(n, np.float32),
                                               versions=np.r_[-1, np.zeros(n - 1, np.int32)], reward=0.0,
                                               group_id=i // group_size, prompt_len=1)
                                    for i, n in enumerate(lengths)]
                    prepared = self.prepare_batch(trajectories, 0)
                    last = None
                    for i, minibatch in enumerate(prepared.minibatches):
                        last = self.minibatch_grads([m.inputs(STEP_KEYS) for m in minibatch], 0,
                                                    units=[m.loss_units for m in minibatch],
                                                    own_proximal=prepared.own_proximal and i == 0)
                        if self.critic_learner is not None:
                            last = (last, self.critic_minibatch_grads([m.inputs(CRITIC_KEYS) for m in minibatch],
                                                                      counts=[m.mask_count for m in minibatch]))
                    jax.block_until_ready(last)
                    self.policy.compiled_update()
                    if self.critic_learner is not None:
                        self.critic_learner.compiled_update()
                done.set_result({"micro_batches": sum(len(mb) for mb in prepared.minibatches),
                                 "seconds": time.perf_counter() - start, "compile_seconds": compiling.seconds})
            except BaseException as e:  # a real batch then compiles what it needs itself
                done.set_exception(e)

        self._ahead = done
        threading.Thread(target=run, name="compile-first-step", daemon=True).start()
        return done

    def _wait_ahead(self) -> float:
        """Wait for ``compile_first_step`` if it runs; returns the seconds waited."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return 0.0
        start = time.perf_counter()
        try:
            ahead.result()
        except Exception as e:
            log.warning("compiling the first step ahead failed (%s: %s); the step compiles what it needs",
                        type(e).__name__, e)
        return time.perf_counter() - start

    def prepare_batch(self, trajectories: Sequence[Trajectory], version: int) -> PreparedBatch:
        """The pre-update half (``trainer/prepare.py``): packed, placed, scored, with advantages."""
        return self.preparer.prepare(trajectories, version, self.policy, self.ref_params, self.critic_learner)

    def train_prepared(self, prepared: PreparedBatch) -> dict[str, float]:
        """The update half: per minibatch, accumulate gradients over its micro-batches, then step
        (the policy, and the critic on the same micro-batches when there is one)."""
        micro_aux, applied, critic_aux, critic_applied = [], [], [], []
        for i, minibatch in enumerate(prepared.minibatches):
            acc, aux = self.minibatch_grads([m.inputs(STEP_KEYS) for m in minibatch],
                                            prepared.version, units=[m.loss_units for m in minibatch],
                                            own_proximal=prepared.own_proximal and i == 0)
            micro_aux.extend(aux)
            applied.append(self.policy.apply(acc))
            if self.critic_learner is not None:
                c_acc, c_aux = self.critic_minibatch_grads([m.inputs(CRITIC_KEYS) for m in minibatch],
                                                           counts=[m.mask_count for m in minibatch])
                critic_aux.extend(c_aux)
                critic_applied.append(self.critic_learner.apply(c_acc))
        micro_aux, applied, critic_aux, critic_applied = fetch((micro_aux, applied, critic_aux, critic_applied))
        skipped = sum(int(a["skipped"]) for a in applied)
        self.policy.count_skipped(skipped)
        self.skipped_steps += skipped
        stats = step_stats.policy_stats(prepared, micro_aux, applied, self.policy.step)
        if self.critic_learner is not None:
            self.critic_learner.count_skipped(sum(int(a["skipped"]) for a in critic_applied))
            stats.update(step_stats.critic_stats(critic_aux, critic_applied))
        return stats

    def minibatch_grads(self, micro_batches: Sequence[dict[str, Any]], version: int = 0,
                        units: Sequence[float] | None = None, own_proximal: bool = False) -> tuple[nnx.State, list]:
        """Gradient of one minibatch's loss, accumulated over its micro-batches (``[rows, length]``
        dicts as ``batching.pack_rows`` makes them, plus ``advantages`` and, when recomputed,
        ``proximal_logprobs``). Each micro-batch's loss is scaled by its share of the minibatch's
        normaliser (``units``, counted from the arrays when not given), so the sum is the
        gradient of the minibatch's loss however it was split. Returns the gradients and each
        micro-batch's statistics (device arrays). ``own_proximal``: the loss takes its own logprobs
        as the proximal ones (the minibatch runs before any update), not ``proximal_logprobs``."""
        if self.algo.loss_aggregation == "constant":
            # Each micro-batch's loss is its token sum over the one constant: the shares add up to
            # the minibatch's sum / constant as they are, however the minibatch was packed.
            scales = [1.0] * len(micro_batches)
        else:
            if units is None:
                units = [loss_units(m, self.algo.loss_aggregation) for m in micro_batches]
            total = sum(units)
            scales = [1.0 if total == 0 else u / total for u in units]
        acc, auxes = self.policy.zeros(), []
        for m, scale in zip(micro_batches, scales, strict=True):
            acc, aux = self.policy.grad(acc, m, {"loss_scale": np.float32(scale),
                                                 "proximal_version": np.float32(version),
                                                 "own_proximal": np.float32(own_proximal)})
            auxes.append(aux)
        return acc, auxes

    def critic_minibatch_grads(self, micro_batches: Sequence[dict[str, Any]],
                               counts: Sequence[float] | None = None) -> tuple[nnx.State, list]:
        """The critic's counterpart of ``minibatch_grads``: the gradient of ``value_coef`` times the
        minibatch's value loss (a token mean), accumulated over micro-batches that hold
        ``input_ids``, ``positions``, ``segment_ids``, ``loss_mask``, ``old_values`` and
        ``returns`` in the position convention (``counts``: their trained tokens, counted from
        the arrays when not given). Returns the gradients and per-micro-batch stats."""
        if self.critic_learner is None:
            raise ValueError(f"adv_estimator={self.algo.adv_estimator!r} keeps no critic")
        if counts is None:
            counts = [float((np.asarray(m["loss_mask"]) > 0).sum()) for m in micro_batches]
        total = sum(counts)
        acc, auxes = self.critic_learner.zeros(), []
        for m, c in zip(micro_batches, counts, strict=True):
            acc, aux = self.critic_learner.grad(acc, m, {"loss_scale": np.float32(1.0 if total == 0 else c / total)})
            auxes.append(aux)
        return acc, auxes


def token_logprobs_only(model: Decoder, batch: dict, **kwargs: Any) -> jax.Array:
    """``token_logprobs`` without its entropy: the policy learner's forward."""
    return token_logprobs(model, batch, **kwargs)[0]

