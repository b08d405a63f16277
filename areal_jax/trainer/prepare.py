"""The pre-update half of a train step: a batch of trajectories becomes packed micro-batches on
the device, scored with the weights before the update, with advantages (and returns).

A batch changes layout once: each trajectory is shifted to the position convention
(``batching.shifted_fields``) and packed into the micro-batches' rows on the host, and from there
on everything stays in those rows. The forward passes' outputs (proximal, reference logprobs,
values) are per position already; the KL penalty, the critic's values and the advantages (group
normalisation by group id, GAE restarted at each packed sequence's end, batch whitening) are
computed on the packed rows, with a segment id per position naming its trajectory; and the
advantages go to the device in the same rows. Nothing is unpacked; ``PreparedBatch``'s
per-trajectory views unpack only when someone inspects them.

In order: plan the micro-batches (``trainer/batching.py``), pack and place each on the mesh,
once; recompute the proximal logprobs with the current policy on exactly those micro-batches,
for every minibatch but the first (trained before any update, its loss takes its own logprobs),
unless they are approximated from versions inside the loss; reference logprobs for a KL reward
penalty (on the behaviour logprobs) when there is a reference; the critic's values when there is
a critic; then advantages (and returns) on the host, placed on the mesh next to the rest.
Nothing is updated.

Multi-host: every process plans and packs the whole batch the same way (the plan is
deterministic, from the lengths only), but places only the rows of each micro-batch that live on
its own devices (``jax.make_array_from_callback``: the callback is asked for local shards only),
so it needs the token arrays of those rows' trajectories only (``row_owners``); of the others it
reads lengths, loss masks and scalars (what the whole batch's advantages need). Per-token outputs
that the host needs back (the KL penalty, values) are computed where the rows live and gathered
from every process; the statistics are replicated scalars.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from areal_jax.algo import AlgoConfig, compute_advantages, explained_variance, proximal
from areal_jax.algo.advantages import dense_run_ids
from areal_jax.algo.kl import kl_penalty_estimate
from areal_jax.data.packing import attention_block_pairs, pair_budget
from areal_jax.data.trajectory import Trajectory
from areal_jax.trainer import batching
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.learner import Learner
from sharding import gather_to_host

FORWARD_KEYS = ("input_ids", "positions", "segment_ids", "attention_pairs")
LOGPROB_KEYS = (*FORWARD_KEYS, "targets")
POLICY_KEYS = (*LOGPROB_KEYS, "loss_mask", "behavior_logprobs", "versions", "advantages")
CRITIC_KEYS = (*FORWARD_KEYS, "loss_mask", "old_values", "returns")
STEP_KEYS = (*POLICY_KEYS, "proximal_logprobs", "ref_logprobs")
"""What the policy's gradient step reads: ``proximal_logprobs`` where they are recomputed,
``ref_logprobs`` (the reference model's, position convention) with a KL loss term."""


@dataclass
class MicroBatch:
    plan: batching.MicroBatchPlan
    arrays: dict[str, Any]
    """``[rows, length]`` fields on the mesh (``proximal_logprobs`` and ``old_values`` included)."""
    loss_units: float = 0.0
    """What the loss aggregation divides by, counted here (see ``loss_units``)."""
    mask_count: float = 0.0
    """Trained tokens here: the critic's value loss is a token mean."""
    host: dict[str, np.ndarray] = field(default_factory=dict)
    """The same rows on the host, whole (every process): the packed fields, ``sequence`` (each
    position's trajectory index, -1 on padding) and, once prepared, ``advantages`` (and with a
    critic ``values`` and ``returns``), all in the position convention. On a follower of a
    multi-process run the token fields of other processes' rows are placeholders (see
    ``row_owners``); loss masks, segments and what is computed from them are real everywhere."""

    def inputs(self, keys: Sequence[str]) -> dict[str, Any]:
        return {k: self.arrays[k] for k in keys if k in self.arrays}


@dataclass
class PreparedBatch:
    """A training batch after the pre-update half of the step: packed, scored, with advantages."""

    trajectories: list[Trajectory]
    version: int
    minibatches: list[list[MicroBatch]]
    stats: dict[str, float] = field(default_factory=dict)
    own_proximal: bool = False
    """The first minibatch's loss takes its own logprobs as the proximal ones (it is trained
    before any update); its ``proximal_logprobs`` only hold the place."""

    def per_trajectory(self, key: str) -> list[np.ndarray] | None:
        """The host field ``key`` of every micro-batch, unpacked per trajectory in the index-``i``
        convention (0 at index 0); None when the micro-batches do not have it. For inspection:
        training reads the packed rows."""
        micro = [m for mb in self.minibatches for m in mb]
        if key not in micro[0].host:
            return None
        return unpack(micro, [m.host[key] for m in micro], [len(t) for t in self.trajectories])

    @property
    def advantages(self) -> list[np.ndarray]:
        """Per trajectory, index-``i`` convention (0 off the loss mask)."""
        return self.per_trajectory("advantages")

    @property
    def values(self) -> list[np.ndarray] | None:
        """With a critic: its pre-update value of each token, index-``i`` convention (0 off the mask)."""
        return self.per_trajectory("values")

    @property
    def returns(self) -> list[np.ndarray] | None:
        """With a critic: the GAE returns the value loss regresses on, index-``i`` convention."""
        return self.per_trajectory("returns")


def fetch(tree: Any) -> Any:
    """``tree``'s arrays on the host, whole (``gather_to_host`` for arrays sharded over other
    processes' devices; every process must call this)."""
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)
    return jax.tree.map(lambda x: gather_to_host(x) if isinstance(x, jax.Array) else x, tree)


def loss_units(arrays: dict[str, Any], aggregation: str) -> float:
    """What the loss aggregation divides by, counted in one packed micro-batch (host arrays):
    sequences for ``seq_mean_token_mean``, trained tokens otherwise."""
    mask = np.asarray(arrays["loss_mask"]) > 0
    if aggregation == "seq_mean_token_mean":
        segments = np.asarray(arrays["segment_ids"])
        ids = np.where(mask, segments + np.arange(mask.shape[0])[:, None] * mask.shape[1], -1)
        return float(len(np.unique(ids[ids >= 0])))
    return float(mask.sum())


def padded_pairs(pairs: Sequence[np.ndarray], budget: int, blocks: int) -> np.ndarray:
    """``int32 [rows, budget, 2]``: each row's block pairs, cut to ``budget`` (only a warm-up's
    placeholder rows have more), the rest padded with query block 0 against the last key block
    (``blocks - 1``), which causality masks."""
    out = np.zeros((len(pairs), budget, 2), np.int32)
    out[..., 1] = blocks - 1
    for r, p in enumerate(pairs):
        out[r, :min(budget, len(p))] = p[:budget]
    return out


class BatchPreparer:
    """Packs, places and scores training batches for one trainer's mesh and configs."""

    def __init__(self, algo: AlgoConfig, train: TrainConfig, *, dp_groups: int, data_sharding: Sharding,
                 pairs_block: int = 0) -> None:
        self.algo, self.train, self.dp_groups, self.data_sharding = algo, train, dp_groups, data_sharding
        self.pairs_block = pairs_block
        """Block size of the attention pairs each micro-batch carries (0: none)."""
        self._pair_budgets: dict[int, list[int]] = {}
        """Per row length, the pair budgets micro-batches have used so far (each a compiled shape),
        ascending. A micro-batch takes the smallest that holds its pairs, and a new budget is made
        only when none does: a run compiles as few pair counts as if budgets only grew, and a
        batch of short answers after a long one costs what it needs, not what that one needed."""
        # Advantages run on small [batch, width] arrays; width is bucketed so this compiles rarely.
        self._adv_fn = jax.jit(compute_advantages, static_argnums=0, static_argnames=("group_size",))
        self._ev_fn = jax.jit(explained_variance)
        self._kl_fn = jax.jit(lambda name, behavior, ref, mask: kl_penalty_estimate(name, behavior, ref) * mask,
                              static_argnums=0)

    @property
    def step_extra_keys(self) -> tuple[str, ...]:
        """The per-token fields a micro-batch carries for the step beyond the trajectories' own:
        advantages, recomputed proximal logprobs, and the reference's logprobs for a KL loss term
        (a field more or less is another compiled shape, so warm-up batches carry the same)."""
        return ("advantages", *(("proximal_logprobs",) if proximal.recomputes(self.algo) else ()),
                *(("ref_logprobs",) if self.algo.kl_loss_coef > 0 else ()))

    def plan(self, lengths: Sequence[int], indices: Sequence[int]) -> list[batching.MicroBatchPlan]:
        t = self.train
        if t.max_seq_len is not None and max(lengths, default=0) > t.max_seq_len:
            longest = max(range(len(lengths)), key=lambda i: lengths[i])
            raise ValueError(f"trajectory {longest} has {lengths[longest]} tokens, more than "
                             f"TrainConfig.max_seq_len={t.max_seq_len}; raise max_seq_len or cap generation")
        return batching.plan_micro_batches(
            lengths, indices, dp_groups=self.dp_groups, token_budget=t.micro_batch_tokens,
            min_micro_batches=t.min_micro_batches, buckets=t.length_buckets)

    def place(self, host: dict[str, np.ndarray], keys: Sequence[str]) -> dict[str, jax.Array]:
        """The host ``[rows, length]`` arrays ``keys`` on the mesh's batch sharding: each process
        sends only the rows its devices hold, each to its devices once."""
        return {k: self._put(host[k]) for k in keys}

    def pack(self, trajectories: Sequence[Trajectory], indices: Sequence[int],
             seqs: Sequence[dict[str, np.ndarray]] | None = None) -> list[MicroBatch]:
        """The micro-batches of ``trajectories[indices]``, packed on the host and placed on the
        mesh (with their attention block pairs when the preparer plans them). ``seqs``: the
        trajectories' ``batching.shifted_fields``, when the caller has them already."""
        seqs = [batching.shifted_fields(t) for t in trajectories] if seqs is None else seqs
        out = []
        for p in self.plan([len(t) for t in trajectories], indices):
            host = batching.pack_rows(seqs, p)
            arrays = self.place(host, list(host))
            host["sequence"] = batching.row_sequences(p, host["segment_ids"])
            pairs = self.attention_pairs([[len(trajectories[i]) for i in row] for row in p.rows], p.length)
            if pairs is not None:
                arrays["attention_pairs"] = self._put(pairs)
            out.append(MicroBatch(p, arrays, loss_units(host, self.algo.loss_aggregation),
                                  float((host["loss_mask"] > 0).sum()), host))
        return out

    def attention_pairs(self, rows: Sequence[Sequence[int]], length: int) -> np.ndarray | None:
        """``[rows, P, 2]``: each packed row's block pairs (rows of sequences of these lengths, padded
        to ``length``), padded to the budget for ``length`` with pairs causality masks; None when
        the preparer plans none or the row is not a whole number of blocks."""
        block = self._pair_block(length)
        if not block:
            return None
        pairs = [attention_block_pairs(lengths, length, block) for lengths in rows]
        return padded_pairs(pairs, self.pair_budget_for(length, length // block, max(len(p) for p in pairs)),
                            length // block)

    def _pair_block(self, length: int) -> int:
        """Block size of the pairs of a row of ``length`` tokens; 0 when the preparer plans none
        for it (no pairs at all, or the row is not a whole number of blocks)."""
        block = min(self.pairs_block, length)
        return block if block and length % block == 0 else 0

    def _put(self, host: np.ndarray) -> jax.Array:
        """A ``[rows, ...]`` host array on the mesh's batch sharding."""
        return jax.make_array_from_callback(host.shape, self.data_sharding, lambda index: host[index])

    def pair_budget_for(self, length: int, blocks: int, needed: int) -> int:
        """The pair budget of a micro-batch of rows of ``length`` tokens (``blocks`` blocks) whose
        rows need at most ``needed`` block pairs: the smallest budget already used that holds
        them, else a new one."""
        used = self._pair_budgets.setdefault(length, [])
        i = bisect.bisect_left(used, needed)
        if i < len(used):
            return used[i]
        budget = pair_budget(needed, blocks)
        bisect.insort(used, budget)
        return budget

    def budget_ladder(self, length: int) -> list[int]:
        """Every pair budget a micro-batch of rows of ``length`` tokens can take (each a compiled
        shape), ascending: ``pair_budget`` of each pair count from one per block up to the most
        a row of sequences of at most ``train.max_seq_len`` tokens can need. Empty when the
        preparer plans no pairs for this length."""
        block = self._pair_block(length)
        if not block:
            return []
        blocks = length // block
        reach = blocks if self.train.max_seq_len is None else -(-self.train.max_seq_len // block) + 1
        most = sum(min(q + 1, reach) for q in range(blocks))
        return sorted({pair_budget(n, blocks) for n in range(blocks, most + 1)})

    def warmup_micro_batches(self, length: int) -> list[MicroBatch]:
        """Micro-batches of rows of ``length`` tokens, one per pair budget of ``budget_ladder``
        (one without pairs when it is empty), with every field a step reads: they compile the
        shapes of that length before real batches meet them (``Trainer.warmup``). Their tokens
        are placeholders. The budgets are registered as used, so real batches take the same ones."""
        seq = length if self.train.max_seq_len is None else min(length, self.train.max_seq_len)
        lengths = [seq] * (length // seq) + ([length % seq] if length % seq else [])
        trajectories = [Trajectory(input_ids=np.full(n, 1, np.int32), loss_mask=np.r_[0.0, np.ones(n - 1)],
                                   behavior_logprobs=np.zeros(n, np.float32),
                                   versions=np.r_[-1, np.zeros(n - 1, np.int32)],
                                   reward=0.0, group_id=0, prompt_len=1) for n in lengths if n > 1]
        seqs = [batching.shifted_fields(t) for t in trajectories]
        plan = batching.MicroBatchPlan(tuple(tuple(range(len(trajectories))) for _ in range(self.dp_groups)), length)
        host = batching.pack_rows(seqs, plan)
        arrays = self.place(host, list(host))
        # The fields of a real micro-batch and no others: a field more or less is another shape.
        for key in self.step_extra_keys:
            arrays[key] = self._put(np.zeros((len(plan.rows), length), np.float32))
        budgets = self.budget_ladder(length)
        if not budgets:
            return [MicroBatch(plan, arrays, 1.0, 1.0)]
        block = self._pair_block(length)
        real = [attention_block_pairs([len(t) for t in trajectories], length, block)] * len(plan.rows)
        self._pair_budgets[length] = sorted(set(self._pair_budgets.get(length, [])) | set(budgets))
        return [MicroBatch(plan, {**arrays, "attention_pairs": self._put(padded_pairs(real, b, length // block))},
                           1.0, 1.0) for b in budgets]

    def logprobs(self, policy: Learner, micro: list[MicroBatch], lengths: Sequence[int],
                 params: Any = None) -> list[np.ndarray]:
        """Per-token logprobs of ``params`` (the policy's current ones by default), unpacked."""
        outs = [policy.forward(m.inputs(LOGPROB_KEYS), params) for m in micro]
        return unpack(micro, fetch(outs), lengths)

    def minibatch_indices(self, n: int) -> list[np.ndarray]:
        """The trajectory indices of each of a batch's ``ppo_n_minibatches`` minibatches."""
        return np.array_split(np.arange(n), self.algo.ppo_n_minibatches)

    def row_owners(self, trajectories: Sequence[Trajectory]) -> list[set[int]]:
        """Per process, the indices of the trajectories packed into rows that its devices hold
        (a row replicated over several processes' devices counts for each). ``prepare`` on a
        process reads the token arrays (``input_ids``, ``behavior_logprobs``, ``versions``) of
        these only; every other trajectory is read for its length, loss mask and scalars. The
        plan is the one ``prepare`` makes (it depends on the lengths only)."""
        lengths = [len(t) for t in trajectories]
        owners: list[set[int]] = [set() for _ in range(jax.process_count())]
        for idx in self.minibatch_indices(len(trajectories)):
            for p in self.plan(lengths, idx):
                for device, index in self.data_sharding.devices_indices_map((len(p.rows), p.length)).items():
                    for row in p.rows[index[0]]:
                        owners[device.process_index].update(row)
        return owners

    def prepare(self, trajectories: Sequence[Trajectory], version: int, policy: Learner,
                reference: Any = None, critic: Learner | None = None) -> PreparedBatch:
        """Pack the batch, recompute proximal (and, with ``reference`` params, reference)
        logprobs with the current weights, score it with ``critic`` if given, and compute
        advantages (and returns), all on the packed rows."""
        trajectories = list(trajectories)
        n_mb = self.algo.ppo_n_minibatches
        if len(trajectories) < n_mb:
            raise ValueError(f"{len(trajectories)} trajectories cannot fill ppo_n_minibatches={n_mb}")
        seqs = [batching.shifted_fields(t) for t in trajectories]
        minibatches = [self.pack(trajectories, idx, seqs) for idx in self.minibatch_indices(len(trajectories))]
        micro = [m for mb in minibatches for m in mb]
        stats: dict[str, float] = {}
        # The first minibatch is trained before any update, so for it the proximal policy is the
        # policy being trained: the loss takes its own logprobs (gradient stopped), the same values
        # a second forward pass would give, without that pass. Later minibatches are trained after
        # updates, so theirs are recomputed now, with the weights before the first.
        # (The first minibatch's micro-batches carry the behaviour logprobs in their place, so that
        # one compiled step serves them all; ``PreparedBatch.own_proximal`` says so.)
        own_proximal = proximal.first_minibatch_own(self.algo)
        if proximal.recomputes(self.algo):
            for m in minibatches[0]:
                m.arrays["proximal_logprobs"] = m.arrays["behavior_logprobs"]
            for m in micro[len(minibatches[0]):]:
                m.arrays["proximal_logprobs"] = policy.forward(m.inputs(LOGPROB_KEYS))
        token_kl = None
        if reference is not None and self.algo.kl_loss_coef > 0:  # the loss term reads them packed
            for m in micro:
                m.arrays["ref_logprobs"] = policy.forward(m.inputs(LOGPROB_KEYS), reference)
        if reference is not None and self.algo.kl_coef > 0:
            # Against the behaviour (inference) logprobs even when proximal ones were recomputed,
            # as AReaL's PPOActor.compute_advantages: it takes recomputed logprobs only for naive
            # PPO with recompute_logprob, a mode this trainer does not have (its naive PPO is
            # against the behaviour policy). Position j holds target j + 1's logprobs on both sides.
            # On the mesh, each row where it lives: a host holds only its own rows' behaviour
            # logprobs (see ``row_owners``), and gets the whole penalty back.
            token_kl = fetch([self._kl_fn(self.algo.kl_estimator, m.arrays["behavior_logprobs"],
                                          m.arrays["ref_logprobs"] if self.algo.kl_loss_coef > 0 else
                                          policy.forward(m.inputs(LOGPROB_KEYS), reference), m.arrays["loss_mask"])
                              for m in micro])
            stats["kl_ref_mean"] = float(sum(k.sum() for k in token_kl) / sum(m.mask_count for m in micro))
        raw_values = None
        if critic is not None:
            for m in micro:
                m.arrays["old_values"] = critic.forward(m.inputs(FORWARD_KEYS))
            # Position j's output is the value before token j + 1, which is where the position
            # convention keeps token j + 1's mask and reward: GAE reads them side by side. The
            # last position of a sequence (mask 0) holds the value after the whole answer, what a
            # truncated answer bootstraps from.
            raw_values = fetch([m.arrays["old_values"] for m in micro])
        stats.update(self.advantages(micro, trajectories, token_kl, raw_values))
        return PreparedBatch(trajectories, version, minibatches, stats, own_proximal=own_proximal)

    def advantages(self, micro: list[MicroBatch], trajectories: Sequence[Trajectory],
                   token_kl: list[np.ndarray] | None = None,
                   raw_values: list[np.ndarray] | None = None) -> dict[str, float]:
        """Advantages (and with a critic returns) of the batch packed in ``micro``, computed on its
        rows: ``host["advantages"]`` (``"values"``, ``"returns"``) of each micro-batch, placed on the
        mesh as ``advantages`` (``returns``). ``token_kl`` and ``raw_values`` are per micro-batch,
        in its rows: the KL penalty per position and the critic's outputs. Returns stats.

        The micro-batches' rows are stacked into one block (rows of a shorter bucket padded at the
        end, the row count rounded up to a power of two, so few shapes compile); each position's
        ``sequence`` says which trajectory it belongs to, and groups are gathered by ``group_id``."""
        sizes: dict[int, int] = {}
        for t in trajectories:
            sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
        group_size = next(iter(sizes.values()))
        # Groups of agent runs with per-turn trajectories: statistics per run, any group sizes.
        runs = dense_run_ids([t.group_id for t in trajectories], [t.run_id for t in trajectories])
        if runs is not None:
            group_size, groups_kw = None, {"group_ids": np.array(runs[0], np.int32),
                                           "run_ids": np.array(runs[1], np.int32),
                                           "discounts": np.array([t.discount for t in trajectories], np.float32)}
        else:
            groups_kw = {"group_ids": np.array([t.group_id for t in trajectories], np.int32)}
        if runs is None and len(set(sizes.values())) > 1 and self.algo.adv_estimator not in ("reinforce_pp", "gae"):
            raise ValueError(f"groups must all have the same size for adv_estimator={self.algo.adv_estimator!r}; "
                             f"got sizes by group_id {sizes}")
        counts = [len(m.plan.rows) for m in micro]
        rows, width = 1 << max(sum(counts) - 1, 0).bit_length(), max(m.plan.length for m in micro)

        def stack(parts: Sequence[np.ndarray], fill: float = 0) -> np.ndarray:
            out = np.full((rows, width), fill, np.asarray(parts[0]).dtype)
            r = 0
            for part in parts:
                out[r:r + part.shape[0], :part.shape[1]] = part
                r += part.shape[0]
            return out

        mask = stack([m.host["loss_mask"] for m in micro])
        sequence = stack([m.host["sequence"] for m in micro], -1)
        kl = None if token_kl is None else stack(token_kl)
        vals = last_values = None
        if raw_values is not None:
            raw = stack([np.asarray(v, np.float32) for v in raw_values])
            vals = raw * mask
            # Each trajectory's last position (its positions are contiguous in one row).
            flat = sequence.reshape(-1)
            seq_ids, last = np.unique(flat[::-1], return_index=True)
            last_values = np.zeros(len(trajectories), np.float32)
            keep = seq_ids >= 0
            last_values[seq_ids[keep]] = raw.reshape(-1)[flat.size - 1 - last[keep]]
        # The overlong penalty measures the loss mask's count (AReaL's), not the answer's length:
        # a multi-turn answer's environment tokens are not the policy's.
        adv, ret = self._adv_fn(
            self.algo, np.array([t.reward for t in trajectories], np.float32), mask, group_size=group_size,
            token_kl=kl, values=vals, truncated=np.array([t.truncated for t in trajectories]),
            last_values=last_values, segments=sequence, **groups_kw)
        stats: dict[str, float] = {}
        if ret is not None:
            count = max(float(mask.sum()), 1.0)
            stats["explained_variance"] = float(self._ev_fn(vals, ret, mask))
            stats["value_mean"] = float((vals * mask).sum() / count)
            stats["return_mean"] = float((np.asarray(ret) * mask).sum() / count)
        per_token = {"advantages": adv} if ret is None else {"advantages": adv, "returns": ret, "values": vals}
        r = 0
        for m, n in zip(micro, counts, strict=True):
            for key, block in per_token.items():
                m.host[key] = np.asarray(block[r:r + n, :m.plan.length], np.float32)
            m.arrays.update(self.place(m.host, [k for k in per_token if k != "values"]))
            r += n
        return stats


def unpack(micro: list[MicroBatch], values: list[np.ndarray], lengths: Sequence[int],
           unshift: bool = True) -> list[np.ndarray]:
    """Per-trajectory arrays from per-micro-batch ``[rows, length]`` outputs (index-``i``
    convention when ``unshift``): for callers that want trajectories back, never the train step."""
    per: dict[int, np.ndarray] = {}
    for m, v in zip(micro, values, strict=True):
        per.update(batching.unpack_rows(v, m.plan, lengths))
    return [batching.unshift(per[i]) if unshift else per[i] for i in range(len(lengths))]
