"""A train step's statistics: the per-micro-batch and per-optimizer-step device stats, read back
once, become the scalars a step reports (token-weighted means, maxima where a mean would hide
the tail, the batch's shape and staleness)."""

from __future__ import annotations

from typing import Any

import numpy as np

from areal_jax.trainer.prepare import PreparedBatch

MAX_STATS = ("behavior_imp_weight_max",)
"""Reported as their maximum over micro-batches, not as a mean."""


def _applied(applied: list[dict[str, Any]], prefix: str = "") -> dict[str, float]:
    norms = [float(a["grad_norm"]) for a in applied if not a["skipped"]] or [float("nan")]
    return {f"{prefix}skipped_steps": float(sum(int(a["skipped"]) for a in applied)),
            f"{prefix}grad_norm": float(np.mean(norms)),
            f"{prefix}grad_norm_max": float(np.max(norms)),
            f"{prefix}lr": float(applied[-1]["lr"])}


def policy_stats(prepared: PreparedBatch, micro: list[dict[str, Any]], applied: list[dict[str, Any]],
                 step: int) -> dict[str, float]:
    """The policy's step statistics from its micro-batches' stats (``micro``) and its optimizer
    steps' (``applied``), both read back from the device; ``step`` is the step count after it."""
    counts = np.array([a["mask_count"] for a in micro], np.float64)
    total = max(counts.sum(), 1.0)
    stats: dict[str, float] = dict(prepared.stats)
    for key in micro[0]:
        if key in ("mask_count", "entropy_sum", "scaled_loss", "loss"):
            continue
        vals = np.array([a[key] for a in micro], np.float64)
        stats[key] = float(vals.max() if key in MAX_STATS else (vals * counts).sum() / total)
    per_mb = np.split(np.array([a["scaled_loss"] for a in micro]),
                      np.cumsum([len(mb) for mb in prepared.minibatches])[:-1])
    stats["loss"] = float(np.mean([s.sum() for s in per_mb]))
    stats["entropy"] = float(sum(a["entropy_sum"] for a in micro) / total)
    stats.update(_applied(applied))
    trajs = prepared.trajectories
    plans = [m.plan for mb in prepared.minibatches for m in mb]
    real = sum(len(t) for t in trajs)
    stats["real_tokens"] = float(real)
    stats["loss_tokens"] = float(total)
    stats["n_micro_batches"] = float(len(plans))
    stats["padding_efficiency"] = real / sum(len(p.rows) * p.length for p in plans)
    stats["reward_mean"] = float(np.mean([t.reward for t in trajs]))
    staleness = [t.staleness(prepared.version) for t in trajs]
    stats["staleness_max"] = float(max(staleness))
    stats["staleness_mean"] = float(np.mean(staleness))
    stats["step"] = float(step)
    return stats


def critic_stats(micro: list[dict[str, Any]], applied: list[dict[str, Any]]) -> dict[str, float]:
    """The critic's step statistics, keys prefixed ``value_`` or ``critic_``."""
    counts = np.array([a["mask_count"] for a in micro], np.float64)
    total = max(counts.sum(), 1.0)
    stats = {k: float((np.array([a[k] for a in micro], np.float64) * counts).sum() / total)
             for k in ("value_loss", "value_clip_fraction")}
    out = _applied(applied, "critic_")
    out.pop("critic_grad_norm_max")
    return {**stats, **out}
