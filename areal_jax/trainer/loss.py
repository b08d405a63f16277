"""The per-micro-batch computations the train step jits: token logprobs and the scaled PPO loss,
and for PPO with a critic, token values and the scaled value loss.

A micro-batch is a dict of ``[rows, length]`` arrays in the position convention of
``trainer/batching.py`` (position ``j`` carries target token ``j + 1``). These functions take a
merged model; the trainer wraps them in ``jax.jit`` over split state.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.algo import AlgoConfig, clipped_value_loss, decoupled_ppo_loss, kl_loss_term, ppo_loss_kwargs
from areal_jax.algo.proximal import loss_proximal_logprobs
from areal_jax.models import Critic, Decoder, chunked_logprobs

Batch = dict[str, jax.Array]


def attention_args(batch: Batch, window: int | None, block: int) -> dict[str, Any]:
    """The model's attention keywords for ``batch``: the window bound, and the block pairs the
    preparer planned for block-sparse attention (when the batch carries them)."""
    return {"attention_window": window, "attention_pairs": batch.get("attention_pairs"), "attention_block": block}


def token_logprobs(
    model: Decoder, batch: Batch, *, temperature: float, chunk_size: int, with_entropy: bool = False,
    attention_window: int | None = None, attention_block: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """``log_softmax(logits / T)`` of each position's target, and optionally the entropy there."""
    hidden = model.hidden_states(batch["input_ids"], batch["positions"], batch["segment_ids"],
                                 **attention_args(batch, attention_window, attention_block))
    head = model.head_weight(whole=True)  # gathered once for every chunk (Decoder.head_weight)
    return chunked_logprobs(
        hidden, batch["targets"], lambda h: model.logits_from_hidden(h, head),
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
    )


def packed_seq_ids(segment_ids: jax.Array) -> jax.Array:
    """Ids unique across rows (``row * length + segment``) for the loss's sequence-level terms.

    A sequence has at least two tokens, so a row holds at most ``length / 2`` segments and the
    largest id, ``rows * length - length / 2``, stays under the loss's bound of ``rows * length``.
    """
    rows, length = segment_ids.shape
    return jnp.arange(rows, dtype=jnp.int32)[:, None] * length + segment_ids


def micro_batch_loss(
    model: Decoder,
    batch: Batch,
    scalars: dict[str, jax.Array],
    *,
    algo: AlgoConfig,
    temperature: float,
    chunk_size: int,
    attention_window: int | None = None,
    attention_block: int = 64,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the minibatch loss, and its (unscaled) statistics.

    ``decoupled_ppo_loss`` normalises within the micro-batch (by its mask count after M2PO's drops,
    or its sequence count); ``scalars["loss_scale"]`` is this micro-batch's share of the
    minibatch's normaliser counted before any drop (AReaL's ``loss_weight_fn``), so the scaled
    losses, and hence their gradients, sum to those of the whole minibatch's loss.
    ``scalars["proximal_version"]`` is the policy version the proximal policy stands for; it is
    read only by the ``loglinear`` approximation. ``scalars["own_proximal"]`` > 0 takes the loss's
    own logprobs (gradient stopped) as the proximal ones in place of ``proximal_logprobs`` or
    the ``loglinear`` estimate; with ``ppo_n_minibatches == 1`` they always are.
    With ``algo.kl_loss_coef > 0`` the KL loss term against ``batch["ref_logprobs"]`` (the
    reference model's) is added, aggregated as the policy loss (``algo.kl.kl_loss_term``).
    """
    logprobs, entropy = token_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size,
                                       with_entropy=True, attention_window=attention_window,
                                       attention_block=attention_block)
    mask = batch["loss_mask"]
    behavior = batch["behavior_logprobs"]
    proximal = loss_proximal_logprobs(algo, logprobs, behavior, batch["versions"], batch.get("proximal_logprobs"),
                                      scalars.get("proximal_version"), scalars.get("own_proximal", 0.0))
    loss, stats = decoupled_ppo_loss(
        logprobs, proximal, behavior, batch["advantages"], mask,
        seq_ids=packed_seq_ids(batch["segment_ids"]), **ppo_loss_kwargs(algo),
    )
    aux: dict[str, Any] = dict(stats)
    if algo.kl_loss_coef > 0:
        kl = kl_loss_term(logprobs, batch["ref_logprobs"], mask, algo.kl_loss_estimator,
                          aggregation=algo.loss_aggregation, constant_normalizer=algo.constant_normalizer,
                          seq_ids=packed_seq_ids(batch["segment_ids"]))
        loss = loss + algo.kl_loss_coef * kl
        aux["kl_loss"] = jax.lax.stop_gradient(kl)
    aux["loss"] = loss
    aux["mask_count"] = jnp.sum(mask)
    aux["entropy_sum"] = jnp.sum(jax.lax.stop_gradient(entropy) * mask)
    return loss * scalars["loss_scale"], aux


def token_values(critic: Critic, batch: Batch, *, attention_window: int | None = None,
                 attention_block: int = 64) -> jax.Array:
    """The critic's output at every position, ``[rows, length]`` float32.

    In the position convention this is already aligned with the targets: position ``j`` has seen
    tokens ``0..j``, so its output is the value before token ``j + 1``, the token whose logprob
    the logits at ``j`` give. Unshifted (``batching.unshift``), index ``i`` holds token ``i``'s value.
    """
    return critic(batch["input_ids"], batch["positions"], batch["segment_ids"],
                  **attention_args(batch, attention_window, attention_block))


def micro_batch_value_loss(
    critic: Critic,
    batch: Batch,
    scalars: dict[str, jax.Array],
    *,
    algo: AlgoConfig,
    attention_window: int | None = None,
    attention_block: int = 64,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This micro-batch's share of the minibatch's value loss (times ``value_coef``), and its
    unscaled statistics. The value loss is a token mean whatever the policy's aggregation, so
    ``scalars["loss_scale"]`` is this micro-batch's share of the minibatch's masked tokens."""
    values = token_values(critic, batch, attention_window=attention_window, attention_block=attention_block)
    mask = batch["loss_mask"]
    loss, stats = clipped_value_loss(values, batch["old_values"], batch["returns"], mask,
                                     eps_clip=algo.value_eps_clip)
    aux: dict[str, Any] = dict(stats)
    aux["mask_count"] = jnp.sum(mask)
    return loss * algo.value_coef * scalars["loss_scale"], aux
