"""PPO with a critic inside the one train step: the old values are the critic's outputs at the
positions whose logits score each token, the PPO preset trains policy and critic (and the critic
learns the returns), the critic's gradient does not depend on packing, compiled shapes stay
bounded, and critic-free presets build no critic."""

import dataclasses
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.config import from_dict, read_config_file
from areal_jax.models import Critic
from areal_jax.trainer import TrainConfig, Trainer, batching
from tests.trainer.helpers import random_trajectories, tiny_model

PRESETS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "algo"


def _preset(name: str, **overrides) -> AlgoConfig:
    return from_dict(AlgoConfig, {**read_config_file(PRESETS / f"{name}.yaml")["algo"], **overrides})


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(tree))])


def test_old_values_are_the_outputs_at_the_preceding_position() -> None:
    """Token i's value is the critic's output at position i - 1 (the position whose logits give
    token i's logprob), computed on packed rows yet equal to an unpacked forward pass. Changing
    a trajectory's last token changes no value: under an off-by-one (position i) it would."""
    critic = Critic(tiny_model().config, rngs=nnx.Rngs(7))  # an explicit critic, not the policy's copy
    trajs = random_trajectories(np.random.default_rng(0), 2, 3)
    direct = [np.asarray(critic(t.input_ids[None])[0]) for t in trajs]
    # gamma = lambda = 1: returns are Monte Carlo, the reward on every answer token.
    algo = AlgoConfig(adv_estimator="gae", gamma=1.0, gae_lambda=1.0, adv_norm=False)
    trainer = Trainer(tiny_model(), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,)), critic=critic)
    prepared = trainer.prepare_batch(trajs, 0)
    assert any(len(m.plan.rows[0]) > 1 for mb in prepared.minibatches for m in mb)  # really packed
    for t, v, d, r, a in zip(trajs, prepared.values, direct, prepared.returns, prepared.advantages, strict=True):
        assert v[0] == 0.0
        np.testing.assert_allclose(v[1:], d[:-1] * t.loss_mask[1:], atol=1e-5)
        np.testing.assert_allclose(r, t.reward * t.loss_mask, atol=1e-5)
        np.testing.assert_allclose(a, (t.reward - v) * t.loss_mask, atol=1e-5)

    last = dataclasses.replace(trajs[0], input_ids=trajs[0].input_ids.copy())
    last.input_ids[-1] = (last.input_ids[-1] + 1) % 128
    moved = trainer.prepare_batch([last, *trajs[1:]], 0).values[0]
    np.testing.assert_allclose(moved, prepared.values[0], atol=1e-6)
    assert abs(float(critic(last.input_ids[None])[0, -1]) - direct[0][-1]) > 1e-4  # the check has teeth


def test_truncated_answers_bootstrap_from_the_value_after_their_last_token() -> None:
    """An answer cut off at the length limit is not terminal: its returns take the critic's value
    of the state after its last token (the output at its last position), as AReaL bootstraps; a
    finished answer's returns are its reward alone. NumPy reference with gamma = lambda = 1."""
    critic = Critic(tiny_model().config, rngs=nnx.Rngs(7))
    trajs = random_trajectories(np.random.default_rng(1), 2, 3)
    trajs = [dataclasses.replace(t, truncated=(i % 2 == 0)) for i, t in enumerate(trajs)]
    direct = [np.asarray(critic(t.input_ids[None])[0]) for t in trajs]
    algo = AlgoConfig(adv_estimator="gae", gamma=1.0, gae_lambda=1.0, adv_norm=False)
    trainer = Trainer(tiny_model(), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,)), critic=critic)
    prepared = trainer.prepare_batch(trajs, 0)
    for t, d, r in zip(trajs, direct, prepared.returns, strict=True):
        bootstrap = d[-1] if t.truncated else 0.0
        np.testing.assert_allclose(r, (t.reward + bootstrap) * t.loss_mask, atol=1e-5)
    assert min(abs(d[-1]) for d, t in zip(direct, trajs, strict=True) if t.truncated) > 1e-3  # the check has teeth


def test_ppo_preset_trains_policy_and_critic_and_the_critic_learns_returns() -> None:
    """``configs/algo/ppo.yaml`` on fixed trajectories with fixed rewards: both models move, and
    the value loss (measured before each update) falls well below its start."""
    trainer = Trainer(tiny_model(), _preset("ppo"),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64), lr=1e-3, critic_lr=3e-3))
    policy0, critic0 = _flat(trainer.policy.params), _flat(trainer.critic_learner.params)
    trajs = random_trajectories(np.random.default_rng(1), 4, 4)
    history = [trainer.train_batch(trajs, step) for step in range(30)]
    losses = [h["value_loss"] for h in history]
    for key in ("value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm", "loss", "grad_norm"):
        assert np.isfinite([h[key] for h in history]).all(), key
    assert history[0]["critic_lr"] == pytest.approx(3e-3) and history[0]["lr"] == pytest.approx(1e-3)
    assert np.abs(_flat(trainer.policy.params) - policy0).max() > 1e-3
    assert np.abs(_flat(trainer.critic_learner.params) - critic0).max() > 1e-3
    assert np.mean(losses[-3:]) < 0.25 * losses[0], losses
    assert history[-1]["explained_variance"] > 0.3 > history[0]["explained_variance"]


def test_critic_gradient_is_the_same_packed_or_padded() -> None:
    """One minibatch's critic gradient and value loss in three layouts: right-padded rows, one
    packed micro-batch, several packed micro-batches. Old values are perturbed so that the clip
    is active on some tokens."""
    trainer = Trainer(tiny_model(), _preset("ppo"), TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64, 256)))
    trajs = random_trajectories(np.random.default_rng(2), 3, 4)
    prepared = trainer.prepare_batch(trajs, 0)
    rng = np.random.default_rng(3)
    seqs = [{"input_ids": t.input_ids, "loss_mask": batching.shifted_fields(t)["loss_mask"],
             "old_values": batching.shift_token_values(v + rng.normal(scale=0.3, size=v.shape)),
             "returns": batching.shift_token_values(r)}
            for t, v, r in zip(trajs, prepared.values, prepared.returns, strict=True)]
    lengths, idx = [len(t) for t in trajs], range(len(trajs))
    layouts = {
        "padded": [batching.padded_plan(lengths, idx, (32,))],
        "one": batching.plan_micro_batches(lengths, idx, dp_groups=1, token_budget=256, min_micro_batches=1,
                                           buckets=(256,)),
        "several": batching.plan_micro_batches(lengths, idx, dp_groups=1, token_budget=64, min_micro_batches=1,
                                               buckets=(32, 64)),
    }
    assert len(layouts["several"]) >= 3
    results = {}
    for name, plans in layouts.items():
        grads, aux = trainer.critic_minibatch_grads([batching.pack_rows(seqs, p) for p in plans])
        aux = jax.device_get(aux)
        counts = np.array([a["mask_count"] for a in aux])
        mean = lambda k: float(sum(a[k] * c for a, c in zip(aux, counts, strict=True)) / counts.sum())  # noqa: B023
        results[name] = (_flat(grads), mean("value_loss"), mean("value_clip_fraction"))
    g_pad, loss_pad, clip_pad = results["padded"]
    assert np.abs(g_pad).max() > 1e-4 and 0 < clip_pad < 1  # not vacuous, both branches of the clip
    for name in ("one", "several"):
        g, loss, clip = results[name]
        np.testing.assert_allclose(loss, loss_pad, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(clip, clip_pad, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(g, g_pad, rtol=1e-4, atol=1e-7, err_msg=name)


def test_critic_compiles_one_shape_per_bucket() -> None:
    buckets = (16, 32, 64)
    trainer = Trainer(tiny_model(), _preset("ppo", ppo_n_minibatches=2),
                      TrainConfig(micro_batch_tokens=64, length_buckets=buckets, lr=1e-3))
    rng = np.random.default_rng(4)
    for step in range(8):
        trajs = random_trajectories(rng, int(rng.integers(2, 5)), 2, prompt_len=(2, 20),
                                    answer_len=(1, int(rng.integers(3, 40))))
        assert np.isfinite(trainer.train_batch(trajs, step)["value_loss"])
    assert 2 <= trainer.critic_learner.grad_fn._cache_size() <= len(buckets)  # several buckets seen, one shape each
    assert trainer.critic_learner.forward_fn._cache_size() <= len(buckets)
    assert trainer.critic_learner.apply_fn._cache_size() == 1


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("*.yaml") if p.stem != "ppo"))
def test_critic_free_presets_build_no_critic(name: str) -> None:
    algo = _preset(name)
    assert algo.adv_estimator != "gae"
    trainer = Trainer(tiny_model(), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,)))
    assert trainer.critic_learner is None and set(trainer.checkpoint_state()) == {"params", "opt_state"}
    with pytest.raises(ValueError, match="keeps no critic"):
        trainer.critic_minibatch_grads([])
