"""Advantage estimators (GRPO, Dr.GRPO, RLOO, REINFORCE++, GAE) and reward shaping.

The group baselines take rewards as ``[num_groups, group_size]`` (the answers sampled for one
prompt form a group), or flat ``[num_groups * group_size]`` with ``group_size`` given, and return
normalised scores of the same shape. As in AReaL, a score then becomes a per-token reward on the
answer's last token, a per-token KL penalty may join it, and GAE over the loss mask (with zero
values when there is no critic: the reward-to-go) turns token rewards into advantages.

The per-token functions take ``[rows, tokens]`` arrays in either of two layouts: one sequence per
row, right-padded (``segments=None``), or the trainer's packed rows, where ``segments [rows,
tokens]`` says which sequence each position belongs to (an index into the per-sequence arrays;
-1 for padding). Each sequence's positions are contiguous and in order, so the packed layout is
the padded one with several sequences side by side: the same recursion, restarted where a
sequence ends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _grouped(rewards: jax.Array, group_size: int | None) -> jax.Array:
    rewards = jnp.asarray(rewards)
    if rewards.ndim == 2:
        return rewards
    if group_size is None:
        raise ValueError("flat rewards need group_size")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    return rewards.reshape(-1, group_size)


def group_std(g: jax.Array, *, unbiased: bool = True) -> jax.Array:
    """Each group's (row's) standard deviation, ``[groups, 1]``. ``unbiased`` divides by ``n - 1``
    (ddof 1), AReaL's default; a group of one then has no spread to estimate and gets std 1,
    as in AReaL, so its advantage is 0 rather than NaN."""
    n = g.shape[1]
    centred = g - g.mean(axis=1, keepdims=True)
    sq = jnp.sum(jnp.square(centred), axis=1, keepdims=True)
    if not unbiased:
        return jnp.sqrt(sq / n)
    if n < 2:
        return jnp.ones_like(sq)
    return jnp.sqrt(sq / (n - 1))


def grpo_advantages(
    rewards: jax.Array, group_size: int | None = None, eps: float = 1e-5, *, unbiased: bool = True
) -> jax.Array:
    """``(r - group mean) / (group std + eps)``. The defaults are AReaL's: the unbiased std
    (ddof 1; a group of one gets std 1) and ``eps = 1e-5``; ``unbiased=False`` is the population
    std (ddof 0). A group whose rewards are all equal gets zeros either way."""
    g = _grouped(rewards, group_size)
    adv = (g - g.mean(axis=1, keepdims=True)) / (group_std(g, unbiased=unbiased) + eps)
    return adv.reshape(jnp.shape(rewards))


def dr_grpo_advantages(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """``r - group mean``: Dr.GRPO drops the std division, which favours easy or hard prompts."""
    g = _grouped(rewards, group_size)
    return (g - g.mean(axis=1, keepdims=True)).reshape(jnp.shape(rewards))


def rloo_advantages(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """``r_i - mean_{j != i} r_j``: the leave-one-out baseline keeps the estimate unbiased."""
    g = _grouped(rewards, group_size)
    n = g.shape[1]
    if n < 2:
        raise ValueError("RLOO needs a group size of at least 2")
    baseline = (g.sum(axis=1, keepdims=True) - g) / (n - 1)
    return (g - baseline).reshape(jnp.shape(rewards))


def row_segments(shape: tuple[int, int]) -> jax.Array:
    """``segments`` of the padded layout: row ``r``'s positions all belong to sequence ``r``."""
    return jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)


def segment_ends(segments: jax.Array) -> jax.Array:
    """``bool [rows, tokens]``: the last position of each run of one segment in a row (padding's
    runs included), where a backward recursion restarts."""
    return jnp.concatenate([segments[:, :-1] != segments[:, 1:], jnp.ones_like(segments[:, :1], bool)], axis=1)


def per_position(per_sequence: jax.Array, segments: jax.Array) -> jax.Array:
    """``per_sequence [S]`` spread over the positions of each sequence; 0 on padding (-1)."""
    padded = jnp.concatenate([jnp.asarray(per_sequence), jnp.zeros(1, jnp.asarray(per_sequence).dtype)])
    return padded[jnp.where(segments >= 0, segments, padded.shape[0] - 1)]


def segment_sums(x: jax.Array, segments: jax.Array, num_segments: int) -> jax.Array:
    """``[S]``: each sequence's sum of ``x [rows, tokens]`` (padding dropped)."""
    seg = jnp.where(segments >= 0, segments, num_segments).reshape(-1)
    return jax.ops.segment_sum(jnp.reshape(x, -1), seg, num_segments=num_segments + 1)[:num_segments]


def gae_advantages(
    token_rewards: jax.Array,
    values: jax.Array,
    loss_mask: jax.Array,
    *,
    gamma: float,
    gae_lambda: float,
    bootstrap_values: jax.Array | None = None,
    segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over ``[batch, tokens]`` (or ``[tokens]``) under a loss mask.

    ``values[t]`` is the critic's value before token ``t``. Tokens off the mask (prompt, padding,
    and in a multi-turn answer the environment's tokens between turns) are skipped, as AReaL
    does: the recursion runs over the masked tokens only, each one's successor being the next
    masked token, so a later turn's reward and values carry back across the gap::

        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lambda * A_next(t)

    where ``next(t)`` is the next masked token after ``t`` in the same sequence. After a
    sequence's last masked token the value is its ``bootstrap_values`` entry (one per sequence:
    per row without ``segments``, a scalar for 1-D input): 0 for an answer that ended (EOS), the
    critic's value of the state after the last token for one cut off at the length limit (AReaL
    bootstraps a truncated answer from its last value). None means 0 for every sequence. Padding
    values never bootstrap. Rewards off the mask are ignored. With ``segments`` (packed rows, see
    the module docstring) the recursion restarts at each sequence's end.
    Returns ``(advantages, returns)`` with ``returns = advantages + values``, both 0 off the mask.
    """
    squeeze = jnp.ndim(token_rewards) == 1
    rewards, values, mask = (jnp.atleast_2d(jnp.asarray(x)) for x in (token_rewards, values, loss_mask))
    mask = mask.astype(rewards.dtype)
    values = values.astype(rewards.dtype) * mask
    padded = segments is None
    segments = row_segments(rewards.shape) if padded else jnp.asarray(segments, jnp.int32)
    if bootstrap_values is None:
        restart = jnp.zeros_like(rewards)
    else:
        boot = jnp.reshape(jnp.asarray(bootstrap_values, rewards.dtype), (-1,))
        restart = per_position(jnp.broadcast_to(boot, rewards.shape[:1]) if padded else boot, segments)

    def step(carry, xs):
        next_value, next_adv = carry
        r, v, m, end, b = xs
        # A sequence's last position (in a packed row, the next one belongs to another sequence
        # or to padding): what follows it is its bootstrap, not the next sequence.
        next_value = jnp.where(end, b, next_value)
        next_adv = jnp.where(end, 0.0, next_adv)
        adv = r + gamma * next_value - v + gamma * gae_lambda * next_adv
        live = m > 0
        return (jnp.where(live, v, next_value), jnp.where(live, adv, next_adv)), adv

    # Scan over time (leading axis) from the end of the row towards its start.
    zeros = jnp.zeros(rewards.shape[0], rewards.dtype)
    xs = (rewards.T, values.T, mask.T, segment_ends(segments).T, restart.T)
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    adv = adv.T * mask
    returns = (adv + values) * mask
    if squeeze:
        return adv[0], returns[0]
    return adv, returns


def shape_rewards(
    rewards: jax.Array, *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> jax.Array:
    """``(r + bias) * scale``, then clipped to ``[-clip, clip]`` when ``clip`` is set."""
    out = (jnp.asarray(rewards) + bias) * scale
    if clip is not None:
        out = jnp.clip(out, -clip, clip)
    return out


def overlong_penalty(
    response_lengths: jax.Array, *, max_len: int, buffer_len: int, penalty_factor: float
) -> jax.Array:
    """DAPO's soft overlong punishment, added to the task reward.

    0 up to ``max_len - buffer_len`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_len``, and ``-penalty_factor`` beyond: long answers are discouraged before they are
    truncated, so truncation is not the only signal. Up to ``max_len`` this is AReaL's
    ``reward_overlong_penalty``; beyond it (only a multi-turn answer's trained tokens get there)
    AReaL's ramp keeps falling, and we keep DAPO's full penalty.
    """
    lengths = jnp.asarray(response_lengths, jnp.float32)
    soft_start = max_len - buffer_len
    ramp = (soft_start - lengths) / buffer_len * penalty_factor
    return jnp.where(lengths <= soft_start, 0.0, jnp.maximum(ramp, -penalty_factor))


def normalize_advantages(
    advantages: jax.Array, loss_mask: jax.Array, eps: float = 1e-5, *, unbiased: bool = True
) -> jax.Array:
    """Batch normalisation over masked tokens: ``(A - mean) / (std + eps)``, 0 off the mask. The
    std is unbiased (``count - 1``) by default with ``eps = 1e-5``, AReaL's defaults."""
    mask = jnp.asarray(loss_mask).astype(advantages.dtype)
    count = jnp.maximum(mask.sum(), 1.0)
    mean = (advantages * mask).sum() / count
    sq = (jnp.square(advantages - mean) * mask).sum()
    var = sq / jnp.maximum(count - 1.0, 1.0) if unbiased else sq / count
    return (advantages - mean) / (jnp.sqrt(var) + eps) * mask


def terminal_token_rewards(seq_rewards: jax.Array, loss_mask: jax.Array,
                           segments: jax.Array | None = None) -> jax.Array:
    """Put each sequence's reward on its last masked token: ``[rows, tokens]``, right-padded with
    one sequence per row, or packed with ``segments`` (see the module docstring)."""
    mask = jnp.asarray(loss_mask).astype(jnp.float32)
    segments = row_segments(mask.shape) if segments is None else jnp.asarray(segments, jnp.int32)
    seq_rewards = jnp.reshape(jnp.asarray(seq_rewards, jnp.float32), -1)
    n = seq_rewards.shape[0]
    flat = jnp.arange(mask.size).reshape(mask.shape)
    seg = jnp.where(segments >= 0, segments, n).reshape(-1)
    last = jax.ops.segment_max(jnp.where(mask > 0, flat, -1).reshape(-1), seg, num_segments=n + 1)
    onehot = ((flat == per_position(last[:n], segments)) & (segments >= 0)).astype(jnp.float32)
    return onehot * per_position(seq_rewards, segments)


def raw_scores(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """No group baseline (REINFORCE++, whose baseline is the token whitening afterwards)."""
    del group_size
    return jnp.asarray(rewards)


def run_group_scores(
    name: str, rewards: jax.Array, group_ids: jax.Array, run_ids: jax.Array, discounts: jax.Array | None = None,
    *, eps: float = 1e-5, unbiased: bool = True,
) -> jax.Array:
    """Group estimator ``name``'s scores when a group's members are agent *runs*, each of which
    may have left several trajectories (per-turn trajectories of one run share its ``run_ids``
    entry). ``rewards``, ``group_ids``, ``run_ids`` and ``discounts`` are ``[batch]``; ids are
    ints in ``0..batch-1``, ``run_ids`` unique across the batch (not only within a group).
    ``discounts`` (default 1) is the factor ``w_i`` by which a turn's reward was discounted from
    its run's (``r_i = w_i * R``).

    The group statistics count each run once, by the reward of its last trajectory in batch
    order (the run's final turn, which carries the undiscounted run reward ``R``), so a run that
    made five calls weighs no more than one that made one. Each trajectory then gets its run's
    score, discounted like its reward::

        grpo:    (r_i - w_i * mean_runs) / (std_runs + eps)   = w_i * (R - mean) / (std + eps)
        dr_grpo:  r_i - w_i * mean_runs
        rloo:     r_i - w_i * (sum_runs - R) / (n_runs - 1)     (0 for a group of one run)

    The discount goes on the score, not only on the reward before normalising: when every run
    of a group earned the same reward, the runs' std is 0, and a discounted earlier turn scored
    against the undiscounted mean would get ``(w - 1) R / eps``, a huge negative advantage for a
    turn of a run as good as any. With one trajectory per run this is the ordinary estimator
    over groups of any size. It is verl-agent's GRPO with ``compute_mean_std_cross_all_data:
    false`` (each ``(uid, traj_uid)`` pair enters its group's mean and std once), with AReaL's
    per-turn reward discount carried over to the score.
    """
    r = jnp.reshape(jnp.asarray(rewards, jnp.float32), -1)
    b = r.shape[0]
    if name == "reinforce_pp":
        return r
    w = jnp.ones_like(r) if discounts is None else jnp.reshape(jnp.asarray(discounts, jnp.float32), -1)
    group_ids = jnp.reshape(jnp.asarray(group_ids, jnp.int32), -1)
    run_ids = jnp.reshape(jnp.asarray(run_ids, jnp.int32), -1)
    pos = jnp.arange(b)
    last = jax.ops.segment_max(pos, run_ids, num_segments=b)
    rep = (pos == last[run_ids]).astype(jnp.float32)
    seg = lambda x: jax.ops.segment_sum(x, group_ids, num_segments=b)[group_ids]
    n = seg(rep)
    total = seg(r * rep)
    mean = total / n
    if name == "dr_grpo":
        return r - w * mean
    if name == "rloo":
        run_reward = jax.ops.segment_sum(r * rep, run_ids, num_segments=b)[run_ids]
        baseline = (total - run_reward) / jnp.maximum(n - 1.0, 1.0)
        return jnp.where(n > 1, r - w * baseline, 0.0)
    if name != "grpo":
        raise ValueError(f"no run-grouped form of estimator {name!r}")
    sq = seg(jnp.square(r - mean) * rep)
    if unbiased:
        std = jnp.where(n > 1, jnp.sqrt(sq / jnp.maximum(n - 1.0, 1.0)), 1.0)
    else:
        std = jnp.sqrt(sq / n)
    return (r - w * mean) / (std + eps)


def dense_run_ids(group_ids: list[int], run_ids: list[int]) -> tuple[list[int], list[int]] | None:
    """Per-trajectory ``(group, run)`` indices, each dense in ``0..batch-1``, for
    ``run_group_scores``; None when no trajectory names a run (``run_id < 0`` everywhere),
    the ordinary case of one trajectory per group member. A trajectory without a run is a run
    of its own."""
    if all(r < 0 for r in run_ids):
        return None
    groups: dict[int, int] = {}
    runs: dict[tuple[int, int], int] = {}
    g_out, r_out = [], []
    for i, (g, r) in enumerate(zip(group_ids, run_ids, strict=True)):
        g_out.append(groups.setdefault(g, len(groups)))
        key = (g, r) if r >= 0 else (g, -1 - i)
        r_out.append(runs.setdefault(key, len(runs)))
    return g_out, r_out


GROUP_ESTIMATORS = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": raw_scores,
}
"""How each critic-free estimator scores a group's sequence rewards before they become token
rewards (AReaL's reward normalisation)."""
STD_NORMALISED = ("grpo",)
"""Group estimators that divide by the group's std (they take ``eps`` and ``unbiased``)."""
TOKEN_WHITENED = ("reinforce_pp",)
"""Estimators whose advantages are whitened over the batch's tokens whatever ``adv_norm`` says."""
