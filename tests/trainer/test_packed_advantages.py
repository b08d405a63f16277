"""Advantages are computed on the packed rows the loss reads, and equal the ones the trainer got
before by unpacking, padding one trajectory per row sorted by group, and packing again
(``helpers.padded_advantages``, that layout kept as the reference): for GRPO with a KL penalty,
REINFORCE++ over groups of different sizes, and GAE with a critic and truncated answers, on
trajectories of ragged lengths whose groups are interleaved and spread over several micro-batches
of different row lengths and two minibatches. A walk of ``BatchPreparer.prepare`` goes down the
house once: shift, pack, forward; nothing is unpacked or packed again."""

import sys

import numpy as np
import pytest
from flax import nnx

from areal_jax.algo import AlgoConfig
from areal_jax.algo.kl import kl_penalty_estimate
from areal_jax.data import packing
from areal_jax.models import Critic
from areal_jax.trainer import TrainConfig, Trainer, batching
from areal_jax.trainer.learner import Learner
from tests.trainer.helpers import padded_advantages, random_trajectories, tiny_model

CASES = {
    "grpo_kl": AlgoConfig(kl_coef=0.3, ppo_n_minibatches=2, mask_no_eos_with_zero=True),
    "reinforce_pp_ragged_groups": AlgoConfig(adv_estimator="reinforce_pp", kl_coef=0.2, kl_estimator="k3",
                                             gamma=0.9, ppo_n_minibatches=2),
    "gae_critic": AlgoConfig(adv_estimator="gae", gamma=0.95, gae_lambda=0.9, adv_norm=True, kl_coef=0.1,
                             ppo_n_minibatches=2),
}


def _batch(case: str) -> list:
    rng = np.random.default_rng(11)
    if case == "grpo_kl":
        trajs = random_trajectories(rng, 3, 4, answer_len=(2, 30))
    else:  # groups of 2, 3 and 5 answers
        trajs = []
        for g, n in enumerate((2, 3, 5)):
            for t in random_trajectories(rng, 1, n, answer_len=(2, 30)):
                t.group_id = g
                trajs.append(t)
    for t in trajs[1::3]:
        t.truncated = True
    return [trajs[i] for i in rng.permutation(len(trajs))]  # groups interleaved


def _trainer(case: str) -> tuple[Trainer, Critic | None]:
    critic = Critic(tiny_model().config, rngs=nnx.Rngs(7)) if case == "gae_critic" else None
    train = TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64))
    return Trainer(tiny_model(), CASES[case], train, critic=critic), critic


@pytest.mark.parametrize("case", list(CASES))
def test_packed_advantages_equal_the_padded_layouts(case: str) -> None:
    trainer, critic = _trainer(case)
    trajs = _batch(case)
    algo = trainer.algo
    prepared = trainer.prepare_batch(trajs, 0)
    micro = [m for mb in prepared.minibatches for m in mb]
    assert len(micro) >= 4
    if case == "grpo_kl":
        assert len({m.plan.length for m in micro}) > 1  # rows of different lengths are stacked
    assert any(len(row) > 1 for m in micro for row in m.plan.rows)  # really packed

    ref = trainer.compute_logprobs(trajs, reference=True)
    token_kl = [np.asarray(kl_penalty_estimate(algo.kl_estimator, t.behavior_logprobs, r)) * t.loss_mask
                for t, r in zip(trajs, ref, strict=True)]
    values = last_values = None
    if critic is not None:  # an unpacked forward pass: token i's value is the output at i - 1
        direct = [np.asarray(critic(t.input_ids[None])[0]) for t in trajs]
        values = [np.r_[0.0, d[:-1]] * t.loss_mask for d, t in zip(direct, trajs, strict=True)]
        last_values = [float(d[-1]) for d in direct]
    want_adv, want_ret = padded_advantages(algo, trajs, token_kl, values, last_values)
    assert max(np.abs(a).max() for a in want_adv) > 0.1  # not vacuous
    mask_sum = sum(t.loss_mask.sum() for t in trajs)
    assert prepared.stats["kl_ref_mean"] == pytest.approx(sum(k.sum() for k in token_kl) / mask_sum, rel=1e-5)

    # per trajectory (the inspection view unpacks) ...
    for got, want in zip(prepared.advantages, want_adv, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if critic is not None:
        for got, want in zip(prepared.returns, want_ret, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for got, want in zip(prepared.values, values, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5)
    else:
        assert prepared.returns is None and "returns" not in micro[0].arrays
    # ... and the loss's inputs on the device: the old path's shifted, packed rows
    seqs = [{"input_ids": t.input_ids, "advantages": batching.shift_token_values(a),
             "returns": batching.shift_token_values(want_ret[i] if want_ret else a)}
            for i, (t, a) in enumerate(zip(trajs, want_adv, strict=True))]
    for m in micro:
        old = batching.pack_rows(seqs, m.plan)
        np.testing.assert_allclose(np.asarray(m.arrays["advantages"]), old["advantages"], rtol=1e-5, atol=1e-5)
        if critic is not None:
            np.testing.assert_allclose(np.asarray(m.arrays["returns"]), old["returns"], rtol=1e-5, atol=1e-5)


def test_a_walk_of_prepare_goes_down_once() -> None:
    """Profile ``prepare`` (GAE with a critic and a KL reference: every branch): each trajectory
    is shifted once, each packed row built once, all before the first forward pass; after it no
    layout code runs, and nothing is unpacked, unshifted or shifted back."""
    trainer, _ = _trainer("gae_critic")
    trajs = _batch("gae_critic")
    layout = {batching.__file__: "batching", packing.__file__: "packing"}
    forward = Learner.forward.__code__
    walk: list[str] = []

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is forward:
            walk.append("forward")
        elif code.co_filename in layout:
            walk.append(f"{layout[code.co_filename]}.{code.co_name}")

    sys.setprofile(profile)
    try:
        prepared = trainer.prepare_batch(trajs, 0)
    finally:
        sys.setprofile(None)
    rows = sum(len(m.plan.rows) for mb in prepared.minibatches for m in mb)
    first = walk.index("forward")
    assert walk.count("batching.shifted_fields") == len(trajs)
    assert walk.count("packing.build_packed_batch") == rows
    assert set(walk[first:]) == {"forward"}, walk[first:]
    for bounce in ("batching.unpack_rows", "batching.unshift", "batching.shift_token_values"):
        assert bounce not in walk
