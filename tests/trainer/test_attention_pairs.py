"""Block-sparse attention in the trainer: the same step as computing every score, the pairs each
micro-batch carries are the ones its rows need, and the pair counts compile few shapes."""

import jax
import numpy as np

from areal_jax.algo import AlgoConfig
from areal_jax.data.packing import attention_block_pairs
from areal_jax.trainer import TrainConfig, Trainer
from areal_jax.trainer.prepare import POLICY_KEYS
from tests.trainer.helpers import random_trajectories, tiny_model


def _trainer(block: int) -> Trainer:
    return Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=2),
                   TrainConfig(micro_batch_tokens=128, length_buckets=(128,), max_seq_len=64, lr=1e-3,
                               attention_block=block))


def test_block_sparse_step_equals_the_full_window_step() -> None:
    """Rows of 128 tokens in blocks of 16, many short sequences each: the first minibatch's
    gradient and the step's statistics are those of computing every score in the window."""
    trajs = random_trajectories(np.random.default_rng(0), 4, 4, prompt_len=(3, 20), answer_len=(2, 40))
    grads, stats = [], []
    for block in (16, 0):
        trainer = _trainer(block)
        prepared = trainer.prepare_batch(trajs, 0)
        micro = prepared.minibatches[0]
        assert ("attention_pairs" in micro[0].arrays) == (block > 0)
        g, _ = trainer.minibatch_grads([m.inputs((*POLICY_KEYS, "proximal_logprobs")) for m in micro], 0,
                                       units=[m.loss_units for m in micro])
        grads.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(g))]))
        stats.append(trainer.train_prepared(prepared))
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert np.abs(grads[1]).max() > 1e-3  # not vacuous
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        np.testing.assert_allclose(stats[0][key], stats[1][key], rtol=2e-5, err_msg=key)


def test_micro_batches_carry_their_rows_pairs_and_reuse_the_smallest_budget_that_fits() -> None:
    rng = np.random.default_rng(1)
    trainer = Trainer(tiny_model(), AlgoConfig(), TrainConfig(micro_batch_tokens=128, length_buckets=(128,),
                                                              max_seq_len=64, attention_block=16))
    budgets, needs = [], []
    # Short answers, long ones, then short again (RL grows a tail, and not every batch holds it):
    # the last short batches must not pay for the long ones' pairs.
    for answer_len in [(2, 6)] * 2 + [(30, 40)] * 2 + [(2, 40)] * 2 + [(2, 6)] * 2:
        trajs = random_trajectories(rng, 3, 3, prompt_len=(3, 20), answer_len=answer_len)
        prepared = trainer.prepare_batch(trajs, 0)
        for m in (m for mb in prepared.minibatches for m in mb):
            pairs = np.asarray(m.arrays["attention_pairs"])
            need = 0
            for r, row in enumerate(m.plan.rows):
                want = attention_block_pairs([len(trajs[i]) for i in row], m.plan.length, 16)
                np.testing.assert_array_equal(pairs[r, :len(want)], want)
                assert (pairs[r, len(want):] == [0, 7]).all()  # padding pairs: masked by causality
                need = max(need, len(want))
            budgets.append(pairs.shape[1])
            needs.append(need)
    # A new budget only when every earlier one is too small, so no more shapes than a budget
    # that only grows; and each micro-batch takes the smallest budget seen that holds it.
    new = [i for i in range(len(budgets)) if budgets[i] not in budgets[:i]]
    assert all(needs[i] > max(budgets[:i], default=0) for i in new) and len(new) <= 3
    for i, (b, n) in enumerate(zip(budgets, needs, strict=True)):
        assert b == min(x for x in budgets[:i + 1] if x >= n)
    assert budgets[-1] < max(budgets)  # the short answers came back to a small budget


def test_block_sparse_step_on_a_mesh_equals_one_device() -> None:
    """data 2 x fsdp 2 x tensor 2: each device attends over its own rows and heads (shard_map);
    the step's statistics and updated params are those of one device computing every score."""
    from sharding import MeshConfig, make_mesh

    trajs = random_trajectories(np.random.default_rng(2), 4, 4, prompt_len=(3, 20), answer_len=(2, 40))
    out = []
    for block, mesh in ((0, None), (16, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))):
        trainer = Trainer(tiny_model(seed=3), AlgoConfig(ppo_n_minibatches=2),
                          TrainConfig(micro_batch_tokens=128, length_buckets=(128,), max_seq_len=64, lr=1e-2,
                                      grad_clip=0.5, attention_block=block), mesh=mesh)
        stats = trainer.train_batch(trajs, 0)
        out.append((stats, jax.tree.leaves(jax.device_get(trainer.policy.params))))
    (ref, ref_params), (got, params) = out
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        np.testing.assert_allclose(got[key], ref[key], rtol=2e-4, atol=1e-6, err_msg=key)
    for p, q in zip(params, ref_params, strict=True):  # Adam: near-zero gradients move by a fraction of lr
        np.testing.assert_allclose(p, q, rtol=1e-4, atol=5e-5)
