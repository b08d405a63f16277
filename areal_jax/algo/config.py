"""``AlgoConfig``, the algorithm room of the config, and the advantage pipeline it drives.

GRPO, Dr.GRPO, RLOO, REINFORCE++, PPO, DAPO and GSPO are presets of this one dataclass (YAML files
under ``configs/algo/`` that only override defaults); the estimator is picked from a table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from areal_jax.algo import advantages as adv_lib
from areal_jax.algo.kl import KL_ESTIMATORS, KL_LOSS_ESTIMATORS
from areal_jax.algo.ppo import AGGREGATIONS, RATIO_LEVELS

PROXIMAL_LOGPROBS_METHODS = ("recompute", "loglinear")


@dataclasses.dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment; see ``advantages.overlong_penalty``. AReaL's
    ``overlong_reward_penalty: true`` with ``overlong_tokens`` and ``overlong_penalty_factor``."""

    buffer_len: int
    """Width of the linear ramp that ends at ``max_len`` (AReaL's ``overlong_tokens``)."""
    penalty_factor: float = 1.0
    """Size of the full penalty, in reward units (AReaL's ``overlong_penalty_factor``)."""
    max_len: int | None = None
    """Answer length (trained tokens) at and beyond which the full penalty applies. None, the
    usual: ``rollout.max_new_tokens``, filled in by the run config, as AReaL takes its
    ``actor.max_new_tokens``."""

    def __post_init__(self) -> None:
        if not self.buffer_len > 0:
            raise ValueError(f"overlong_penalty.buffer_len must be positive, got {self.buffer_len}")
        if self.max_len is not None and not self.buffer_len <= self.max_len:
            raise ValueError(f"need buffer_len <= max_len, got {self.buffer_len}, {self.max_len}")


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """How rewards become advantages and how the policy loss is formed. Defaults are GRPO."""

    adv_estimator: str = "grpo"
    """One of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` (critic-free) or ``gae`` (critic)."""
    eps_clip: float = 0.2
    """PPO clip range below 1 (and above 1 unless ``eps_clip_higher`` is set)."""
    eps_clip_higher: float | None = None
    """Clip range above 1 (DAPO's clip-higher); None means ``eps_clip``."""
    c_clip: float | None = None
    """Dual-clip bound (> 1) on the loss of negative-advantage tokens; None disables it."""
    use_behavior_imp_weight: bool = True
    """Multiply each token's loss by its behaviour importance weight ``pi_prox / pi_behav``
    (the decoupled objective's correction). AReaL applies it only when its
    ``rejection_sampling`` is set (its GSM8K recipes set it); False is AReaL without
    ``rejection_sampling``, and needs ``behavior_imp_weight_cap: null``."""
    behavior_imp_weight_cap: float | None = 5.0
    """Tokens whose proximal/behavior weight exceeds this are dropped from the loss, still counted
    in the token mean (AReaL's ``rejection_sampling: {metric: ratio, upper: 5.0}``, token level,
    action ``mask``); None keeps all."""
    m2_threshold: float | None = None
    """M2PO's trust region against the behavior policy (AReaL's ``m2_threshold``; 0.04 in its
    recipe): in each micro-batch, the tokens with the largest squared log proximal/behavior weight
    are dropped from the loss until the mean square of the rest is below this. None: no drop."""
    use_decoupled_loss: bool = True
    """AReaL's decoupled objective; False is naive PPO against the behavior policy (ablation)."""
    ratio_level: str = "token"
    """``token`` (PPO) or ``sequence`` (GSPO)."""
    loss_aggregation: str = "token_mean"
    """``token_mean``, ``seq_mean_token_mean`` or ``constant`` (sum / ``constant_normalizer``)."""
    constant_normalizer: float | None = None
    """Divisor of a minibatch's summed token losses when ``loss_aggregation == 'constant'``
    (Dr.GRPO), whatever its packing into micro-batches: typically sequences per minibatch times
    max new tokens."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference *reward* penalty, AReaL's form (its ``kl_ctl``; verl's
    ``use_kl_in_reward``): a per-token reward ``-kl_coef * kl`` on the behaviour logprobs, added
    after the group normalisation of the task reward. It is not a loss term: it moves the policy
    only through the advantages. For the loss form of GRPO, Tunix and verl's ``use_kl_loss``,
    set ``kl_loss_coef``. With both 0 no reference model is built at all."""
    kl_estimator: str = "k1"
    """Per-token KL estimator for the reward penalty: ``k1``, ``k2`` or ``k3`` (clamped to
    +-10, AReaL's)."""
    kl_loss_coef: float = 0.0
    """Weight of the KL-to-reference *loss* term (GRPO's beta; verl's ``kl_loss_coef`` with
    ``use_kl_loss``, Tunix's ``beta``): ``kl_loss_coef * KL`` added to the policy loss, the KL
    estimated per token on the logprobs being trained against the reference model's and
    aggregated as the policy loss (``loss_aggregation``), so its gradient pulls the policy
    towards the reference directly. The reference is the policy at the start of RL (after any
    warm start). 0: no loss term."""
    kl_loss_estimator: str = "low_var_kl"
    """The loss term's per-token KL: ``k1`` (``logp - ref``), ``k2`` (``(logp - ref)^2 / 2``) or
    ``k3``/``low_var_kl`` (``exp(ref - logp) - (ref - logp) - 1``, clamped as verl's), verl's
    default for GRPO."""
    reward_scale: float = 1.0
    """Rewards become ``(r + reward_bias) * reward_scale`` before the estimator."""
    reward_bias: float = 0.0
    """Added to rewards before scaling."""
    reward_clip: float | None = None
    """Shaped rewards are clipped to ``[-reward_clip, reward_clip]``; None disables clipping
    (AReaL's default is 20)."""
    mask_no_eos_with_zero: bool = False
    """An answer cut off at ``max_new_tokens`` without EOS gets score 0 in place of its
    (normalised) reward, as AReaL's ``mask_no_eos_with_zero``; its per-token KL reward stays."""
    adv_norm: bool = False
    """Normalise advantages over the batch's masked tokens after the estimator (AReaL's
    ``adv_norm: {mean_level: batch, std_level: batch}``)."""
    std_unbiased: bool = True
    """Standard deviations of GRPO's group normalisation and of the token whitening (``adv_norm``,
    REINFORCE++) divide by ``n - 1`` (AReaL's default); False divides by ``n``. A GRPO group of
    one then gets std 1 (advantage 0), as in AReaL."""
    norm_eps: float = 1e-5
    """Added to those standard deviations before dividing (AReaL's default)."""
    gamma: float = 1.0
    """Discount of GAE; without a critic, of the reward-to-go (GAE with zero values, as AReaL)."""
    gae_lambda: float = 1.0
    """GAE's lambda; 1 gives Monte Carlo returns minus the value baseline. Without a critic the
    reward-to-go is discounted by ``gamma * gae_lambda`` per masked token."""
    proximal_logprobs: str = "recompute"
    """``recompute`` (a forward pass of the proximal policy) or ``loglinear`` (approximate it,
    ``proximal.approx_proximal_logprobs``). Either way the first minibatch of a batch, trained before
    any update, takes its own logprobs, which are exact and cost nothing: with
    ``ppo_n_minibatches: 1`` neither a pass nor the approximation is ever used."""
    overlong_penalty: OverlongPenalty | None = None
    """DAPO's soft overlong punishment added to rewards; None disables it."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per training batch; each takes an equal share of the sequences."""
    value_coef: float = 0.5
    """Weight of the critic's value loss; used only with ``adv_estimator == 'gae'``. The critic has
    its own optimizer, so under Adam this matters mostly against ``TrainConfig.grad_clip``."""
    value_eps_clip: float | None = 0.2
    """Clip range of the value loss, in return units: a step gains nothing from moving a value
    further than this from the value the returns were computed with. None: plain squared error."""

    def __post_init__(self) -> None:
        if isinstance(self.overlong_penalty, dict):
            # YAML gives a mapping; an unknown key in it fails here like a top-level typo does.
            object.__setattr__(self, "overlong_penalty", OverlongPenalty(**self.overlong_penalty))
        choices = {
            "adv_estimator": tuple(ESTIMATORS),
            "ratio_level": RATIO_LEVELS,
            "loss_aggregation": AGGREGATIONS,
            "kl_estimator": tuple(KL_ESTIMATORS),
            "kl_loss_estimator": KL_LOSS_ESTIMATORS,
            "proximal_logprobs": PROXIMAL_LOGPROBS_METHODS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.constant_normalizer is not None and not self.constant_normalizer > 0:
            raise ValueError(
                f"constant_normalizer must be positive, got {self.constant_normalizer}: it divides the summed "
                f"token losses, so 0 is undefined and a negative value would flip the gradient into ascent"
            )
        if self.loss_aggregation == "constant" and self.constant_normalizer is None:
            raise ValueError("loss_aggregation='constant' needs a positive constant_normalizer")
        if not self.norm_eps >= 0:
            raise ValueError(f"norm_eps must be >= 0, got {self.norm_eps}")
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"m2_threshold must be positive or None, got {self.m2_threshold}")
        if self.m2_threshold is not None and not self.use_decoupled_loss:
            raise ValueError("m2_threshold needs use_decoupled_loss: naive PPO has no proximal policy, so there is "
                             "no proximal/behavior weight to bound; set algo.m2_threshold: null or "
                             "algo.use_decoupled_loss: true")
        if self.c_clip is not None and self.c_clip <= 1.0:
            raise ValueError(f"c_clip must be > 1, got {self.c_clip}")
        if self.behavior_imp_weight_cap is not None and not self.use_behavior_imp_weight:
            raise ValueError("behavior_imp_weight_cap drops tokens by the behaviour importance weight, which "
                             "use_behavior_imp_weight: false does not apply; set algo.behavior_imp_weight_cap: null "
                             "too (AReaL: rejection_sampling: null)")
        if self.proximal_logprobs == "loglinear" and not self.use_decoupled_loss:
            raise ValueError("proximal_logprobs='loglinear' only makes sense with use_decoupled_loss")
        if self.value_eps_clip is not None and self.value_eps_clip <= 0:
            raise ValueError(f"value_eps_clip must be positive or None, got {self.value_eps_clip}")
        if self.ppo_n_minibatches < 1:
            raise ValueError("ppo_n_minibatches must be >= 1")
        for name in ("kl_coef", "kl_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}: a negative weight would push the "
                                 "policy away from the reference")

    @property
    def uses_reference(self) -> bool:
        """Whether training needs the reference model (a KL reward penalty or a KL loss term)."""
        return self.kl_coef > 0 or self.kl_loss_coef > 0


def ppo_loss_kwargs(cfg: AlgoConfig) -> dict[str, Any]:
    """The keyword arguments of ``decoupled_ppo_loss`` that this config fixes."""
    return {
        "eps_clip": cfg.eps_clip,
        "eps_clip_higher": cfg.eps_clip_higher,
        "c_clip": cfg.c_clip,
        "behavior_imp_weight_cap": cfg.behavior_imp_weight_cap,
        "use_behavior_imp_weight": cfg.use_behavior_imp_weight,
        "m2_threshold": cfg.m2_threshold,
        "use_decoupled": cfg.use_decoupled_loss,
        "ratio_level": cfg.ratio_level,
        "aggregation": cfg.loss_aggregation,
        "constant_normalizer": cfg.constant_normalizer,
    }


def _token_rewards(cfg: AlgoConfig, scores: jax.Array, loss_mask: jax.Array, token_kl: jax.Array | None,
                   no_eos: jax.Array | None, segments: jax.Array | None) -> jax.Array:
    """The score on each answer's last masked token (0 for an answer without EOS under
    ``mask_no_eos_with_zero``), plus ``-kl_coef * kl`` on every masked token."""
    scores = scores.reshape(-1)
    if cfg.mask_no_eos_with_zero and no_eos is not None:
        scores = jnp.where(no_eos, 0.0, scores)
    token_rewards = adv_lib.terminal_token_rewards(scores, loss_mask, segments)
    if token_kl is not None:
        token_rewards = token_rewards - cfg.kl_coef * token_kl * loss_mask
    return token_rewards


def _grouped_scores(name: str, cfg: AlgoConfig, seq_rewards: jax.Array, group_size: int | None,
                    group_ids: jax.Array | None) -> jax.Array:
    """The estimator's scores of ``seq_rewards [S]``, in their order. Without ``group_ids`` the
    rewards come group after group; with them, a stable sort by group id gathers each group
    (every group ``group_size`` long) and the scores go back to the sequences' places."""
    norm = {"eps": cfg.norm_eps, "unbiased": cfg.std_unbiased} if name in adv_lib.STD_NORMALISED else {}
    estimator = adv_lib.GROUP_ESTIMATORS[name]
    if group_ids is None:
        return estimator(seq_rewards, group_size, **norm)
    order = jnp.argsort(jnp.reshape(jnp.asarray(group_ids), -1), stable=True)
    return jnp.zeros_like(seq_rewards).at[order].set(estimator(seq_rewards[order], group_size, **norm))


def _group_estimator(name: str) -> Callable[..., tuple[jax.Array, jax.Array | None]]:
    def estimate(cfg, seq_rewards, loss_mask, group_size, values, token_kl, bootstrap, no_eos, segments, group_ids,
                 runs):
        # AReaL: normalise the task reward in its group, then add the per-token KL reward, then
        # take GAE with zero values (the reward-to-go); the KL is never divided by a group's std.
        # Without a critic every value is 0, a truncated answer's bootstrap included.
        if runs is None:
            scores = _grouped_scores(name, cfg, seq_rewards, group_size, group_ids)
        else:  # groups of agent runs, a run's per-turn trajectories counted once
            norm = {"eps": cfg.norm_eps, "unbiased": cfg.std_unbiased} if name in adv_lib.STD_NORMALISED else {}
            scores = adv_lib.run_group_scores(name, seq_rewards, *runs, **norm)
        token_rewards = _token_rewards(cfg, scores, loss_mask, token_kl, no_eos, segments)
        advantages, _ = adv_lib.gae_advantages(
            token_rewards, jnp.zeros_like(token_rewards), loss_mask, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda,
            segments=segments,
        )
        if name in adv_lib.TOKEN_WHITENED and not cfg.adv_norm:  # adv_norm whitens once, as AReaL
            advantages = adv_lib.normalize_advantages(advantages, loss_mask, cfg.norm_eps, unbiased=cfg.std_unbiased)
        return advantages, None

    return estimate


def _gae_estimator(cfg, seq_rewards, loss_mask, group_size, values, token_kl, bootstrap, no_eos, segments,
                   group_ids, runs):
    if values is None:
        raise ValueError("adv_estimator='gae' needs values from the critic")
    token_rewards = _token_rewards(cfg, seq_rewards, loss_mask, token_kl, no_eos, segments)
    return adv_lib.gae_advantages(
        token_rewards, values, loss_mask, gamma=cfg.gamma, gae_lambda=cfg.gae_lambda, bootstrap_values=bootstrap,
        segments=segments,
    )


ESTIMATORS: dict[str, Callable[..., tuple[jax.Array, jax.Array | None]]] = {
    **{name: _group_estimator(name) for name in adv_lib.GROUP_ESTIMATORS},
    "gae": _gae_estimator,
}


def compute_advantages(
    cfg: AlgoConfig,
    rewards: jax.Array,
    loss_mask: jax.Array,
    *,
    group_size: int | None = None,
    values: jax.Array | None = None,
    token_kl: jax.Array | None = None,
    response_lengths: jax.Array | None = None,
    truncated: jax.Array | None = None,
    last_values: jax.Array | None = None,
    segments: jax.Array | None = None,
    group_ids: jax.Array | None = None,
    run_ids: jax.Array | None = None,
    discounts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Sequence rewards ``[batch]`` (grouped, group after group) to token advantages ``[batch, tokens]``.

    Two layouts of the per-token arrays (``advantages`` module docstring): one sequence per row,
    right-padded, the default; or packed rows, where ``segments [rows, tokens]`` names each
    position's sequence (-1: padding) and the per-sequence arrays (``rewards``, ``truncated``,
    ``last_values``, ``response_lengths``, ``group_ids``) are indexed by it. ``group_ids [batch]``
    lets the sequences come in any order (groups are gathered by a stable sort); without it they
    come group after group. The trainer takes the packed layout, so that advantages are computed
    on the very rows the loss reads.

    In order, AReaL's (``PPOActor._compute_advantages``): DAPO overlong penalty (lengths default
    to the mask's row sums, AReaL's loss-mask count), reward bias, scale and clip; the
    estimator's group normalisation of the sequence rewards (AReaL's ``reward_norm``; none for
    GAE and REINFORCE++); the score on the answer's last masked token (0 for an answer without
    EOS under ``mask_no_eos_with_zero``) plus, when ``token_kl`` is given, a
    reward ``-kl_coef * kl`` on every masked token; GAE over the loss mask (zero values without a
    critic: the reward-to-go; masked gaps in multi-turn answers are carried across); token
    whitening for REINFORCE++; then masked batch normalisation if ``adv_norm``. Returns
    ``(advantages, returns)``; ``returns`` is None for the critic-free estimators.

    ``truncated [batch]`` marks answers cut off at the length limit without EOS; with a critic,
    GAE bootstraps each of them from ``last_values [batch]``, the critic's value of the state
    after the answer's last token (AReaL's ``values[:, -1] * no_eos``), while a finished answer's
    value after its last token is 0. None: every answer finished. (AReaL calls an answer
    "no EOS" when it fills the padded batch's width; we use the rollout's own finish reason.)

    ``run_ids [batch]`` with ``group_ids`` (both dense, from ``advantages.dense_run_ids``)
    replace ``group_size`` for groups of agent runs that left several trajectories each
    (``agentic`` with ``trajectory: per_turn``): the group statistics count each run once and
    each turn gets its run's score times its ``discounts`` entry (default 1), see
    ``advantages.run_group_scores``. Groups may then differ in size.
    """
    rewards = jnp.reshape(rewards, -1).astype(jnp.float32)
    loss_mask = jnp.asarray(loss_mask).astype(jnp.float32)
    if cfg.overlong_penalty is not None:
        if response_lengths is None:
            response_lengths = (loss_mask.sum(axis=-1) if segments is None
                                else adv_lib.segment_sums(loss_mask, segments, rewards.shape[0]))
        p = cfg.overlong_penalty
        if p.max_len is None:
            raise ValueError("algo.overlong_penalty.max_len is unset: a run config fills it from "
                             "rollout.max_new_tokens; called directly, give it a value")
        rewards = rewards + adv_lib.overlong_penalty(
            response_lengths, max_len=p.max_len, buffer_len=p.buffer_len, penalty_factor=p.penalty_factor
        )
    rewards = adv_lib.shape_rewards(
        rewards, scale=cfg.reward_scale, bias=cfg.reward_bias, clip=cfg.reward_clip
    )
    if cfg.kl_coef == 0.0:
        token_kl = None
    bootstrap = None
    if truncated is not None:
        truncated = jnp.reshape(jnp.asarray(truncated), -1).astype(bool)
    if truncated is not None and cfg.adv_estimator == "gae":
        if last_values is None:
            raise ValueError("truncated answers need last_values (the critic's value after each answer's last "
                             "token) for GAE to bootstrap from")
        bootstrap = jnp.where(truncated, jnp.reshape(jnp.asarray(last_values, jnp.float32), -1), 0.0)
    if run_ids is not None and group_ids is None:
        raise ValueError("run_ids need group_ids (advantages.dense_run_ids gives both)")
    runs = None if run_ids is None else (group_ids, run_ids, discounts)
    advantages, returns = ESTIMATORS[cfg.adv_estimator](
        cfg, rewards, loss_mask, group_size, values, token_kl, bootstrap, truncated, segments, group_ids, runs)
    if cfg.adv_norm:
        advantages = adv_lib.normalize_advantages(advantages, loss_mask, cfg.norm_eps, unbiased=cfg.std_unbiased)
    return advantages, returns
