"""Supervised warm start: cross-entropy on reference answers of the task's own prompts, before RL.

A small model that never produces the answer format gets no reward signal to learn from; a few
supervised steps on ``(prompt, reference answer)`` pairs teach the format (and some of the task),
so RL has something to sharpen. Prompt tokens carry no loss. Every batch is padded to one
length, so the step compiles once.

The steps run through a ``Learner`` (``trainer/learner.py``), the RL trainer's own core: float32
master weights and AdamW state sharded like the params on the run's mesh, the batch's rows split
over its data-parallel groups, the gradient clipped to ``train.grad_clip``, decay on matrices
only, logprobs formed chunk by chunk (no ``[batch, length, vocab]`` logits), the run's compute
dtype, and a step with a non-finite gradient skipped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from areal_jax.data.datasets import PromptRow, last_boxed
from areal_jax.models.logprobs import logprobs_from_logits
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.learner import Learner
from areal_jax.trainer.loss import token_logprobs
from sharding import DEFAULT_RULES, MeshConfig, gather_to_host, make_mesh
from sharding.rules import Rules


@dataclass
class SFTConfig:
    """The ``warm_start:`` section."""

    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Examples per step, drawn at random from the training split."""
    lr: float = 1e-3
    """Peak AdamW learning rate, reached by a linear warmup over ``warmup_steps``."""
    warmup_steps: int = 10
    """Steps of the linear warmup from 0 to ``lr``."""
    schedule: str = "constant"
    """After the warmup: ``constant`` (``lr`` to the end), or ``cosine`` (down to 0 at ``steps``).
    At a constant high rate the last few batches decide where the weights end up, so the warm
    start's accuracy moves with the seed and with rounding; a decay to 0 settles it."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (on every parameter here)."""
    max_len: int = 128
    """Prompt + answer tokens of one example; longer examples are left out."""
    answer_format: str = "{answer}"
    """How a reference answer becomes the target text (``{answer}`` is replaced)."""
    seed: int = 0
    """Seed of the example draws."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"warm_start.schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}")


SCHEDULES = ("constant", "cosine")


def sft_train_config(cfg: SFTConfig, train: TrainConfig | None = None) -> TrainConfig:
    """The ``TrainConfig`` the warm start's ``Learner`` runs: the run's optimizer and numerics
    (``train``: clipping, Adam's betas and eps, compute dtype, remat) with the warm start's own
    learning rate, schedule and weight decay, one row length (``max_len``)."""
    base = train or TrainConfig()
    warmup = max(cfg.warmup_steps, 1)
    return dataclasses.replace(
        base, lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=warmup,
        lr_schedule="warmup_cosine" if cfg.schedule == "cosine" else "constant",
        total_steps=max(cfg.steps, warmup + 1), min_lr_ratio=0.0, temperature=1.0,
        micro_batch_tokens=cfg.max_len, length_buckets=(cfg.max_len,), max_seq_len=None,
        remat="none" if base.remat == "auto" else base.remat)


def lr_schedule(cfg: SFTConfig) -> optax.Schedule:
    """The warm start's learning rate at each step (see ``SFTConfig.schedule``)."""
    return sft_train_config(cfg).schedule()


def reference_answer(row: PromptRow) -> str:
    """The row's reference answer: a reasoning-gym entry's, GSM8K's final answer, MATH's boxed one."""
    f = row.reward_fields
    if "entry" in f:
        return str(f["entry"]["answer"])
    if "answer" in f:
        return str(f["answer"])
    if "solution" in f and last_boxed(str(f["solution"])) is not None:
        return last_boxed(str(f["solution"]))
    raise ValueError(f"row {row.id}: no reference answer for a warm start (needs entry, answer or a boxed solution)")


def sft_examples(rows: Sequence[PromptRow], tokenizer: Any, cfg: SFTConfig) -> list[tuple[list[int], list[int]]]:
    """``(prompt_ids, answer_ids)`` pairs, the answer ending in the end-of-turn token."""
    eos = tokenizer.eos_token_id
    out = []
    for row in rows:
        answer = tokenizer.encode(cfg.answer_format.format(answer=reference_answer(row)), add_special_tokens=False)
        if len(row.prompt_ids) + len(answer) + 1 <= cfg.max_len:
            out.append((list(row.prompt_ids), [*answer, eos]))
    if not out:
        raise ValueError(f"warm_start: no example fits warm_start.max_len={cfg.max_len}; raise it")
    return out


def pad_batch(examples: Sequence[tuple[list[int], list[int]]], length: int) -> dict[str, np.ndarray]:
    """Right-padded ``input_ids``, ``positions``, ``segment_ids`` and the next-token ``targets`` and
    ``loss_mask`` (1 where the target is an answer token)."""
    b = len(examples)
    ids = np.zeros((b, length), np.int32)
    seg = np.zeros((b, length), np.int32)
    mask = np.zeros((b, length), np.float32)
    for i, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[i, :n] = p + a
        seg[i, :n] = 1
        mask[i, len(p) - 1:n - 1] = 1.0  # position j predicts token j + 1
    targets = np.concatenate([ids[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy()
    return {"input_ids": ids, "positions": positions, "segment_ids": seg, "targets": targets, "loss_mask": mask}


def sft_loss(model: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean negative log-likelihood of the answer tokens, from whole logits (a reference for
    ``sft_micro_batch_loss``, which the warm start trains on)."""
    logits = model(batch["input_ids"], batch["positions"], batch["segment_ids"])
    logp = logprobs_from_logits(logits, batch["targets"])
    mask = batch["loss_mask"]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sft_micro_batch_loss(model: Any, batch: dict[str, jax.Array], scalars: dict[str, jax.Array], *,
                         chunk_size: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``sft_loss`` with the logits formed chunk by chunk, in the ``Learner``'s loss form."""
    logp, _ = token_logprobs(model, batch, temperature=1.0, chunk_size=chunk_size)
    mask = batch["loss_mask"]
    loss = -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)
    return loss * scalars["loss_scale"], {"loss": loss}


def warm_start(model: Any, cfg: SFTConfig, tokenizer: Any, rows: Sequence[PromptRow],
               examples: Sequence[tuple[list[int], list[int]]] | None = None, *, train: TrainConfig | None = None,
               mesh: Mesh | None = None, rules: Rules = DEFAULT_RULES) -> dict[str, Any]:
    """Train ``model`` in place on the rows' reference answers (or on ``examples``, ``(prompt_ids,
    answer_ids)`` pairs made elsewhere) through a ``Learner`` on ``mesh`` (default: the mesh the
    model's params live on, or its one device) with the optimizer and numerics of ``train``
    (``sft_train_config``); its weights come back in the model's own dtypes. Returns loss and
    timing stats. In a multi-process run every process calls this with the same examples."""
    examples = list(examples) if examples is not None else sft_examples(rows, tokenizer, cfg)
    t = sft_train_config(cfg, train)
    mesh = mesh if mesh is not None else _mesh_of(model)
    learner = Learner(model, train=t, lr=cfg.lr, mesh=mesh, rules=rules,
                      loss=partial(sft_micro_batch_loss, chunk_size=t.logprob_chunk_size),
                      forward=lambda m, b: token_logprobs(m, b, temperature=1.0, chunk_size=t.logprob_chunk_size)[0])
    groups = int(mesh.shape["data"] * mesh.shape["fsdp"])
    rng = np.random.default_rng(cfg.seed)
    losses, applied = [], []
    t0 = time.perf_counter()
    one = {"loss_scale": np.float32(1.0)}
    for _ in range(cfg.steps):
        pick = rng.choice(len(examples), size=min(cfg.batch_size, len(examples)), replace=False)
        batch = place_rows(pad_batch([examples[i] for i in pick], cfg.max_len), learner.data_sharding, groups)
        acc, aux = learner.grad(learner.zeros(), batch, one)
        applied.append(learner.apply(acc)["skipped"])
        losses.append(aux["loss"])
    losses, applied = ([float(gather_to_host(x)) for x in xs] for xs in (losses, applied))
    # The trained weights, in the dtypes the model keeps (a bfloat16 checkpoint stays bfloat16).
    _, state = nnx.split(model)
    nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype), learner.params, state))
    return {"steps": cfg.steps, "examples": len(examples), "skipped_steps": int(sum(applied)),
            "loss_first": losses[0] if losses else float("nan"),
            "loss_last": float(np.mean(losses[-5:])) if losses else float("nan"), "seconds": time.perf_counter() - t0}


def place_rows(batch: dict[str, np.ndarray], sharding: NamedSharding, groups: int) -> dict[str, jax.Array]:
    """A host batch on the learner's data sharding: rows split over the ``groups`` data-parallel
    groups, padded with empty rows (no tokens, no loss) to a multiple of them. In a multi-process
    run each process fills only its own devices, from its copy (every process draws the same
    batch)."""
    rows = next(iter(batch.values())).shape[0]
    pad = -rows % groups
    if pad:
        batch = {k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index]) for k, v in batch.items()}


def _mesh_of(model: Any) -> Mesh:
    """The mesh ``model``'s params live on, or a one-device mesh on the device that holds them."""
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.mesh
    device = next(iter(sharding.device_set)) if sharding is not None else jax.devices()[0]
    return make_mesh(MeshConfig(), devices=[device])
