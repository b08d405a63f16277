"""Supervised warm start: cross-entropy on reference answers of the task's own prompts, before RL.

A small model that never produces the answer format gets no reward signal to learn from; a few
supervised steps on ``(prompt, reference answer)`` pairs teach the format (and some of the task),
so RL has something to sharpen. Prompt tokens carry no loss. Every batch is padded to one
length, so the step compiles once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from areal_jax.data.datasets import PromptRow, last_boxed
from areal_jax.models.logprobs import logprobs_from_logits


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


def lr_schedule(cfg: SFTConfig) -> optax.Schedule:
    """The warm start's learning rate at each step (see ``SFTConfig.schedule``)."""
    warmup = max(cfg.warmup_steps, 1)
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(cfg.steps, warmup + 1), end_value=0.0)
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)],
                                [warmup])


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
    """Mean negative log-likelihood of the answer tokens."""
    logits = model(batch["input_ids"], batch["positions"], batch["segment_ids"])
    logp = logprobs_from_logits(logits, batch["targets"])
    mask = batch["loss_mask"]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def warm_start(model: Any, cfg: SFTConfig, tokenizer: Any, rows: Sequence[PromptRow],
               examples: Sequence[tuple[list[int], list[int]]] | None = None) -> dict[str, Any]:
    """Train ``model`` in place on the rows' reference answers (or on ``examples``, ``(prompt_ids,
    answer_ids)`` pairs made elsewhere); returns loss and timing stats."""
    examples = list(examples) if examples is not None else sft_examples(rows, tokenizer, cfg)
    tx = optax.adamw(lr_schedule(cfg), weight_decay=cfg.weight_decay)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: sft_loss(nnx.merge(graphdef, p, rest), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(cfg.seed)
    losses = []
    t0 = time.perf_counter()
    place = _batch_placer(params)
    for _ in range(cfg.steps):
        pick = rng.choice(len(examples), size=min(cfg.batch_size, len(examples)), replace=False)
        batch = place(pad_batch([examples[i] for i in pick], cfg.max_len))
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
    nnx.update(model, params)
    losses = [float(x) for x in jax.device_get(losses)]
    return {"steps": cfg.steps, "examples": len(examples), "loss_first": losses[0] if losses else float("nan"),
            "loss_last": float(np.mean(losses[-5:])) if losses else float("nan"), "seconds": time.perf_counter() - t0}


def _batch_placer(params: Any) -> Any:
    """How a host batch reaches the step. On a mesh, its rows are split over the mesh's batch axes
    (``data`` and ``fsdp``) when they divide evenly, else replicated; in a multi-process run each
    process fills only its own devices, from its copy (every process draws the same batch). On
    one device, as it is (jit places it)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from sharding import DEFAULT_RULES, logical_to_sharding

    leaf = jax.tree.leaves(params)[0]
    if not isinstance(leaf.sharding, NamedSharding) or leaf.sharding.mesh.size == 1:
        return lambda batch: batch
    mesh = leaf.sharding.mesh
    split = logical_to_sharding(("batch", None), mesh, DEFAULT_RULES)
    ways = int(np.prod([mesh.shape[a] for axes in split.spec if axes for a in np.atleast_1d(axes)]))

    def place(batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        rows = next(iter(batch.values())).shape[0]
        sharding = split if rows % ways == 0 else NamedSharding(mesh, PartitionSpec())
        return {k: jax.make_array_from_callback(v.shape, sharding, lambda index, v=v: v[index])
                for k, v in batch.items()}

    return place
