"""The train step's arithmetic: packing and micro-batching do not change the gradient, proximal
logprobs are the pre-update model's, the KL reference exists only when asked for, and the number
of compiled shapes stays bounded by the length buckets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.algo import AlgoConfig, OverlongPenalty, compute_advantages
from areal_jax.models import logprobs_from_logits
from areal_jax.trainer import TrainConfig, Trainer, batching
from areal_jax.trainer.prepare import LOGPROB_KEYS, POLICY_KEYS
from tests.trainer.helpers import padded_advantages, random_trajectories, tiny_model

TEMPERATURE = 0.8


def _micro_batches(trainer: Trainer, trajs: list, plans: list) -> list[dict]:
    """Micro-batch dicts with recomputed proximal logprobs and the trainer's advantages."""
    proximal = trainer.compute_logprobs(trajs)
    advantages = trainer.prepare_batch(trajs, 0).advantages
    seqs = []
    for t, p, a in zip(trajs, proximal, advantages, strict=True):
        s = batching.shifted_fields(t)
        s["proximal_logprobs"] = batching.shift_token_values(p)
        s["advantages"] = batching.shift_token_values(a)
        seqs.append(s)
    return [batching.pack_rows(seqs, p) for p in plans]


def _grads(trainer: Trainer, micro: list[dict]) -> tuple[np.ndarray, float]:
    grads, aux = trainer.minibatch_grads(micro)
    flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(grads))])
    return flat, float(sum(a["scaled_loss"] for a in jax.device_get(aux)))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_packed_equals_padded_and_accumulation_equals_one_micro_batch(aggregation: str) -> None:
    """Three layouts of the same minibatch give one loss and one gradient: one sequence per row
    right-padded; packed into one big micro-batch; packed into several small micro-batches.
    Dr.GRPO's ``constant`` is the minibatch's token sum over the constant: the token mean times
    (masked tokens / constant), whatever the layout."""
    constant = 37.0 if aggregation == "constant" else None
    trainer = Trainer(tiny_model(), AlgoConfig(loss_aggregation=aggregation, eps_clip=0.1,
                                               constant_normalizer=constant),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64, 256), temperature=TEMPERATURE))
    trajs = random_trajectories(np.random.default_rng(0), 3, 4)
    lengths = [len(t) for t in trajs]
    idx = range(len(trajs))
    padded = [batching.padded_plan(lengths, idx, (32,))]
    one = batching.plan_micro_batches(lengths, idx, dp_groups=1, token_budget=256, min_micro_batches=1,
                                      buckets=(256,))
    several = batching.plan_micro_batches(lengths, idx, dp_groups=1, token_budget=64, min_micro_batches=1,
                                          buckets=(32, 64))
    assert len(one) == 1 and len(several) >= 3
    g_pad, l_pad = _grads(trainer, _micro_batches(trainer, trajs, padded))
    g_one, l_one = _grads(trainer, _micro_batches(trainer, trajs, one))
    g_sev, l_sev = _grads(trainer, _micro_batches(trainer, trajs, several))
    assert abs(l_pad) > 1e-4 and np.abs(g_pad).max() > 1e-4  # the comparison is not vacuous
    np.testing.assert_allclose(l_one, l_pad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(l_sev, l_one, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(g_one, g_pad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(g_sev, g_one, rtol=1e-4, atol=1e-7)
    if aggregation == "constant":
        mean = Trainer(tiny_model(), AlgoConfig(eps_clip=0.1), trainer.train)
        g_mean, l_mean = _grads(mean, _micro_batches(mean, trajs, one))
        tokens = sum(float(t.loss_mask[1:].sum()) for t in trajs)
        np.testing.assert_allclose(l_one, l_mean * tokens / constant, rtol=1e-5)
        np.testing.assert_allclose(g_one, g_mean * tokens / constant, rtol=1e-4, atol=1e-7)


def test_attention_window_keeps_the_gradient_and_bounds_lengths() -> None:
    """With ``max_seq_len`` set, long packed rows use block-local attention: same loss and
    gradient as full attention; a trajectory longer than the window is refused by name."""
    algo = AlgoConfig(eps_clip=0.1)
    base = dict(micro_batch_tokens=512, length_buckets=(512,), temperature=TEMPERATURE)
    full = Trainer(tiny_model(), algo, TrainConfig(**base))
    local = Trainer(tiny_model(), algo, TrainConfig(**base, max_seq_len=40))
    trajs = random_trajectories(np.random.default_rng(1), 4, 4, prompt_len=(5, 15), answer_len=(10, 25))
    lengths = [len(t) for t in trajs]
    plans = batching.plan_micro_batches(lengths, range(len(trajs)), dp_groups=1, token_budget=512,
                                        min_micro_batches=1, buckets=(512,))
    assert len(plans) == 1 and sum(lengths) > 3 * 128  # one row of several 128-token attention blocks
    g_full, l_full = _grads(full, _micro_batches(full, trajs, plans))
    g_local, l_local = _grads(local, _micro_batches(local, trajs, plans))
    np.testing.assert_allclose(l_local, l_full, rtol=1e-5)
    np.testing.assert_allclose(g_local, g_full, rtol=1e-4, atol=1e-7)
    too_long = random_trajectories(np.random.default_rng(2), 1, 1, prompt_len=(30, 31), answer_len=(20, 21))
    with pytest.raises(ValueError, match=r"50 tokens, more than TrainConfig.max_seq_len=40"):
        local.train_batch(too_long, 0)


def test_recomputed_proximal_logprobs_are_the_pre_update_models() -> None:
    model = tiny_model(seed=3)
    trajs = random_trajectories(np.random.default_rng(2), 2, 3)
    expected = []
    for t in trajs:
        logits = model(jnp.asarray(t.input_ids)[None])[0]
        expected.append(np.asarray(logprobs_from_logits(logits[:-1], jnp.asarray(t.input_ids[1:]), TEMPERATURE)))
    trainer = Trainer(model, AlgoConfig(ppo_n_minibatches=2), TrainConfig(micro_batch_tokens=64, length_buckets=(64,),
                                                                          temperature=TEMPERATURE, lr=1e-2))
    got = trainer.compute_logprobs(trajs)
    for g, e, t in zip(got, expected, trajs, strict=True):
        assert g[0] == 0.0 and g.shape == (len(t),)
        np.testing.assert_allclose(g[1:], e, atol=2e-5)
    # Inside train_batch, the minibatches after the first carry logprobs from before the first
    # update. The first runs before any update: its loss takes its own, with no second pass.
    twin = Trainer(tiny_model(seed=3), AlgoConfig(ppo_n_minibatches=2),
                   TrainConfig(micro_batch_tokens=64, length_buckets=(64,), temperature=TEMPERATURE, lr=1e-2))
    prepared = trainer.prepare_batch(trajs, 0)
    first, *later = prepared.minibatches
    assert later and prepared.own_proximal
    assert all(m.arrays["proximal_logprobs"] is m.arrays["behavior_logprobs"] for m in first)  # a placeholder
    lengths = [len(t) for t in trajs]
    inside: dict[int, np.ndarray] = {}
    for m in (m for mb in later for m in mb):
        inside.update(batching.unpack_rows(np.asarray(m.arrays["proximal_logprobs"]), m.plan, lengths))
    assert inside
    for i, g in inside.items():
        np.testing.assert_allclose(batching.unshift(g)[1:], expected[i], atol=2e-5)
    # ... and trains to the same weights as with recomputed ones for the first minibatch too
    recomputed = twin.prepare_batch(trajs, 0)
    for m in recomputed.minibatches[0]:
        m.arrays["proximal_logprobs"] = twin.policy.forward(m.inputs(LOGPROB_KEYS))
    recomputed.own_proximal = False
    trainer.train_prepared(prepared)
    twin.train_prepared(recomputed)
    for a, b in zip(jax.tree.leaves(trainer.policy.params), jax.tree.leaves(twin.policy.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    moved = trainer.compute_logprobs(trajs)
    assert max(np.abs(m - g).max() for m, g in zip(moved, got, strict=True)) > 1e-3


def test_one_minibatch_takes_the_proximal_logprobs_from_its_own_forward_pass() -> None:
    """With one optimizer step per batch nothing is updated before the loss runs, so the proximal
    logprobs are the loss's own: no second forward pass, the same gradient and statistics as with
    the recomputed ones."""
    trajs = random_trajectories(np.random.default_rng(4), 3, 3, version=2)
    for t in trajs:  # stale behaviour: importance weights away from 1, some above the cap
        t.behavior_logprobs = t.behavior_logprobs + np.random.default_rng(5).normal(0, 1.0, len(t)) * t.loss_mask
    trainer = Trainer(tiny_model(seed=2), AlgoConfig(behavior_imp_weight_cap=2.0),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(64,), temperature=TEMPERATURE))
    prepared = trainer.prepare_batch(trajs, 4)
    (micro,) = prepared.minibatches
    assert all("proximal_logprobs" not in m.arrays for m in micro)
    batches = [m.inputs(POLICY_KEYS) for m in micro]
    recomputed = [{**b, "proximal_logprobs": trainer.policy.forward(m.inputs(LOGPROB_KEYS))}
                  for b, m in zip(batches, micro, strict=True)]
    own, own_aux = trainer.minibatch_grads(batches, 4)
    ref, ref_aux = trainer.minibatch_grads(recomputed, 4)
    for a, b in zip(jax.tree.leaves(own), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
    assert float(np.max(np.abs(np.asarray(jax.tree.leaves(ref)[0])))) > 0
    for a, b in zip(own_aux, ref_aux, strict=True):
        for k in ("loss", "dropped_fraction", "behavior_imp_weight_mean", "clip_fraction"):
            np.testing.assert_allclose(float(a[k]), float(b[k]), rtol=1e-4, atol=1e-6)
    assert max(float(a["dropped_fraction"]) for a in own_aux) > 0  # the cap bit, identically in both


def test_loglinear_proximal_needs_no_forward_and_interpolates() -> None:
    """Two minibatches of tokens from version 3 trained at version 5: the first takes its own
    logprobs (exact, and free: nothing has been updated), the second the loglinear estimate,
    alpha = (5 - 3) / (6 - 3), so its behavior importance weight is
    ``exp(2/3 * (logp_theta - logp_behavior))``. Neither runs a proximal forward pass."""
    algo = AlgoConfig(proximal_logprobs="loglinear", behavior_imp_weight_cap=None, ppo_n_minibatches=2)
    trainer = Trainer(tiny_model(seed=1), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,)))
    trajs = random_trajectories(np.random.default_rng(3), 2, 3, version=3)
    current = trainer.compute_logprobs(trajs)
    logged = trainer.policy.forward_fn._cache_size()
    prepared = trainer.prepare_batch(trajs, 5)
    assert trainer.policy.forward_fn._cache_size() == logged  # no proximal forward pass
    assert prepared.own_proximal and all("proximal_logprobs" not in m.arrays for mb in prepared.minibatches
                                         for m in mb)
    halves = np.array_split(np.arange(len(trajs)), 2)
    for i, (minibatch, idx) in enumerate(zip(prepared.minibatches, halves, strict=True)):
        _, aux = trainer.minibatch_grads([m.inputs(POLICY_KEYS) for m in minibatch], 5, own_proximal=i == 0)
        aux = jax.device_get(aux)
        got = sum(float(a["behavior_imp_weight_mean"]) * float(a["mask_count"]) for a in aux) / sum(
            float(a["mask_count"]) for a in aux)
        # First minibatch: the proximal policy is the current one, log w = logp_theta - logp_behavior;
        # later ones: the estimate sits 2/3 of the way from the behavior logprobs to the current ones.
        alpha = 1.0 if i == 0 else 2 / 3
        log_w = np.concatenate([alpha * (current[j] - trajs[j].behavior_logprobs)[trajs[j].loss_mask > 0]
                                for j in idx])
        np.testing.assert_allclose(got, np.exp(log_w).mean(), rtol=1e-4)


def test_loglinear_with_one_minibatch_takes_the_exact_proximal_logprobs() -> None:
    """With one minibatch the exact proximal logprobs are the loss's own: ``loglinear`` changes
    nothing, the gradient is the one ``recompute`` gives."""
    trajs = random_trajectories(np.random.default_rng(6), 2, 3, version=1)
    cfg = TrainConfig(micro_batch_tokens=64, length_buckets=(64,))
    grads = []
    for method in ("loglinear", "recompute"):
        trainer = Trainer(tiny_model(seed=4), AlgoConfig(proximal_logprobs=method), cfg)
        (micro,) = trainer.prepare_batch(trajs, 4).minibatches
        g, _ = trainer.minibatch_grads([m.inputs(POLICY_KEYS) for m in micro], 4)
        grads.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(g))]))
    np.testing.assert_array_equal(grads[0], grads[1])
    assert np.abs(grads[0]).max() > 0


def test_kl_reference_only_when_kl_coef_positive() -> None:
    trajs = random_trajectories(np.random.default_rng(4), 2, 4)
    cfg = TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2)
    plain = Trainer(tiny_model(), AlgoConfig(kl_coef=0.0), cfg)
    assert plain.ref_params is None
    with pytest.raises(ValueError, match="reference"):
        plain.compute_logprobs(trajs, reference=True)

    trainer = Trainer(tiny_model(), AlgoConfig(kl_coef=0.5), cfg)
    assert trainer.ref_params is not None
    initial = jax.device_get(trainer.ref_params)
    trainer.train_batch(trajs, 0)
    prepared = trainer.prepare_batch(trajs, 1)
    assert abs(prepared.stats["kl_ref_mean"]) > 1e-4
    without, _ = padded_advantages(trainer.algo, trajs)
    diff = max(np.abs(a - b).max() for a, b in zip(prepared.advantages, without, strict=True))
    assert diff > 1e-3  # the penalty changed the rewards the advantages came from
    for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(jax.device_get(trainer.ref_params)), strict=True):
        np.testing.assert_array_equal(a, b)  # the reference stays frozen


@pytest.mark.parametrize("decoupled", [True, False])
def test_kl_penalty_takes_behavior_logprobs(decoupled: bool) -> None:
    """The per-token KL against the reference (``kl_ref_mean`` and the advantages' penalty) is
    taken on the behaviour logprobs, as AReaL's ``compute_advantages``, also when the decoupled
    loss recomputed proximal ones. The policy is first moved off the reference, so the candidates
    (behaviour, current policy: a small step away) give different KLs."""
    trajs = random_trajectories(np.random.default_rng(6), 2, 4)
    algo = AlgoConfig(kl_coef=0.5, kl_estimator="k3", adv_estimator="reinforce_pp", use_decoupled_loss=decoupled)
    trainer = Trainer(tiny_model(), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-3,
                                                      temperature=TEMPERATURE))
    trainer.train_batch(trajs, 0)
    prepared = trainer.prepare_batch(trajs, 1)
    ref = trainer.compute_logprobs(trajs, reference=True)
    mask_sum = sum(t.loss_mask.sum() for t in trajs)

    def penalty(candidate: list[np.ndarray]) -> tuple[float, list[np.ndarray]]:
        log_ratio = [r - c for c, r in zip(candidate, ref, strict=True)]
        kl = [(np.exp(d) - d - 1) * t.loss_mask for d, t in zip(log_ratio, trajs, strict=True)]  # k3
        return sum(k.sum() for k in kl) / mask_sum, padded_advantages(trainer.algo, trajs, kl)[0]

    behavior_kl, behavior_adv = penalty([t.behavior_logprobs for t in trajs])
    current_kl, _ = penalty(trainer.compute_logprobs(trajs))
    assert abs(behavior_kl - current_kl) > 0.5 * behavior_kl  # the candidates are told apart
    assert prepared.stats["kl_ref_mean"] == pytest.approx(behavior_kl, rel=1e-4)
    for got, want in zip(prepared.advantages, behavior_adv, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_compiled_shapes_bounded_by_buckets() -> None:
    """Fifty batches of random sizes and lengths compile at most one grad and one logprob shape
    per length bucket, and one apply."""
    buckets = (16, 32, 64)
    trainer = Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=2),
                      TrainConfig(micro_batch_tokens=64, length_buckets=buckets, lr=1e-3))
    rng = np.random.default_rng(5)
    for step in range(50):
        trajs = random_trajectories(rng, int(rng.integers(2, 5)), 2, prompt_len=(2, 20),
                                    answer_len=(1, int(rng.integers(3, 40))))
        stats = trainer.train_batch(trajs, step)
        assert np.isfinite(stats["loss"]) and 0 < stats["padding_efficiency"] <= 1
    assert trainer.policy.grad_fn._cache_size() <= len(buckets)
    assert trainer.policy.forward_fn._cache_size() <= len(buckets)
    assert trainer.policy.apply_fn._cache_size() == 1
    assert trainer.policy.step == 100


def test_bfloat16_compute_keeps_float32_master_params() -> None:
    trajs = random_trajectories(np.random.default_rng(6), 2, 4)
    cfg = dict(micro_batch_tokens=64, length_buckets=(64,), lr=1e-3)
    f32 = Trainer(tiny_model(), AlgoConfig(), TrainConfig(**cfg)).train_batch(trajs, 0)
    trainer = Trainer(tiny_model(), AlgoConfig(), TrainConfig(compute_dtype="bfloat16", **cfg))
    assert trainer.policy.graphdef != trainer.policy.source_graphdef
    # Before any update both trainers hold the same float32 weights: their logprobs differ only by
    # bfloat16 rounding, which must show (were bfloat16 ignored, they would agree to ~1e-7).
    lp32 = np.concatenate(Trainer(tiny_model(), AlgoConfig(), TrainConfig(**cfg)).compute_logprobs(trajs))
    lp16 = np.concatenate(trainer.compute_logprobs(trajs))
    gap = np.abs(lp16 - lp32).max()
    assert 1e-4 < gap < 0.1, gap
    bf16 = trainer.train_batch(trajs, 0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(trainer.policy.params))
    np.testing.assert_allclose(bf16["entropy"], f32["entropy"], rtol=2e-2)
    np.testing.assert_allclose(bf16["grad_norm"], f32["grad_norm"], rtol=0.1)


def test_weight_decay_reaches_matrices_only() -> None:
    """Stacked layers give norm scales a leading axis; decay is still for kernels and embeddings."""
    from flax import nnx

    from areal_jax.trainer.learner import decayed as _decayed

    flags = {jax.tree_util.keystr(p): v for p, v in
             jax.tree_util.tree_flatten_with_path(_decayed(nnx.state(tiny_model(), nnx.Param)))[0]}
    assert all(v == ("kernel" in k or "embedding" in k) for k, v in flags.items()), flags
    assert any("layernorm" in k for k in flags) and any("q_proj']['kernel" in k for k in flags)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_each_micro_batch_goes_to_the_device_once(estimator: str) -> None:
    """``prepare_batch`` places every packed array on the mesh (explicitly, once); the update half
    then moves nothing from the host implicitly (the guard raises on any such copy)."""
    trainer = Trainer(tiny_model(), AlgoConfig(adv_estimator=estimator, ppo_n_minibatches=2),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(32, 64), lr=1e-3))
    trajs = random_trajectories(np.random.default_rng(11), 3, 2)
    prepared = trainer.prepare_batch(trajs, 0)
    for m in (m for mb in prepared.minibatches for m in mb):
        for key, value in m.arrays.items():
            assert isinstance(value, jax.Array) and value.sharding == trainer.policy.data_sharding, key
    with jax.transfer_guard_host_to_device("disallow"):
        stats = trainer.train_prepared(prepared)
    assert np.isfinite(stats["loss"]) and stats["lr"] == pytest.approx(1e-3)
    assert trainer.policy.step == 2


@pytest.mark.parametrize("n_minibatches", [2, 1])
def test_warmup_compiles_every_shape_that_real_batches_then_meet(n_minibatches: int) -> None:
    """``Trainer.warmup`` compiles the gradient (and, where batches recompute proximal logprobs,
    the forward) for each length bucket and each attention pair budget a micro-batch can take,
    and applies nothing. Twelve batches of growing lengths afterwards compile no new gradient or
    forward shape, while the same batches on a trainer without the warm-up meet several shapes
    one by one, so the check can tell. With one minibatch (the default) real micro-batches carry
    no proximal logprobs, and the warm-up's must not either, or every shape compiles again."""
    from flax import nnx

    def trainer(lr: float) -> Trainer:
        return Trainer(tiny_model(), AlgoConfig(ppo_n_minibatches=n_minibatches),
                       TrainConfig(micro_batch_tokens=128, length_buckets=(64, 128), attention_block=32,
                                   max_seq_len=96, lr=lr))

    # Another learning rate: the cold trainer's steps are its own, not the warm one's (learners of
    # one configuration share their compiled steps, ``learner.shared_steps``)
    warm, cold = trainer(1e-3), trainer(2e-3)
    assert cold.policy.grad_fn is not warm.policy.grad_fn
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(warm.model(), nnx.Param))]
    stats = warm.warmup()
    ladders = {n: warm.preparer.budget_ladder(n) for n in (64, 128)}
    assert ladders[64][0] == 2 and ladders[128][0] == 4 and len(ladders[128]) > 2  # one pair per block, up
    assert stats["shapes"] == sum(len(v) for v in ladders.values()) and stats["compile_seconds"] > 0
    forwards = stats["shapes"] if n_minibatches > 1 else 0
    assert warm.policy.grad_fn._cache_size() == stats["shapes"] and warm.policy.forward_fn._cache_size() == forwards
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(warm.model(), nnx.Param))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)) and warm.policy.step == 0

    rng = np.random.default_rng(7)
    for step in range(12):  # answers growing longer, as under RL: more block pairs, new budgets
        trajs = random_trajectories(rng, 4, 4, prompt_len=(2, 12), answer_len=(1, 4 + 5 * step))
        for t in (warm, cold):
            assert np.isfinite(t.train_batch(trajs, step)["loss"])
    assert warm.policy.grad_fn._cache_size() == stats["shapes"] and warm.policy.forward_fn._cache_size() == forwards
    assert cold.policy.grad_fn._cache_size() >= 3
    assert max(map(len, cold.preparer._pair_budgets.values())) >= 2  # budgets a cold run met one by one


def test_learners_of_one_configuration_share_their_steps_and_nothing_else() -> None:
    """A second trainer of the same model and configuration takes the first's jitted steps (no
    second trace of any shape the first compiled) and trains exactly as the first did from the
    same start: the shared steps hold no learner's params. A learner is not kept alive by them,
    and a trainer whose loss differs (another temperature) gets steps of its own."""
    import gc
    import weakref

    def trainer(temperature: float = TEMPERATURE) -> Trainer:
        return Trainer(tiny_model(seed=5), AlgoConfig(ppo_n_minibatches=2),
                       TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2, temperature=temperature))

    trajs = random_trajectories(np.random.default_rng(12), 2, 3)
    first = trainer()
    stats = first.train_batch(trajs, 0)
    compiled = first.policy.grad_fn._cache_size()
    assert compiled >= 1
    second = trainer()
    assert second.policy.grad_fn is first.policy.grad_fn and second.policy.apply_fn is first.policy.apply_fn
    again = second.train_batch(trajs, 0)
    assert second.policy.grad_fn._cache_size() == compiled  # nothing traced again
    assert again["loss"] == stats["loss"] and again["grad_norm"] == stats["grad_norm"]
    for a, b in zip(jax.tree.leaves(first.policy.params), jax.tree.leaves(second.policy.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert trainer(temperature=0.5).policy.grad_fn is not first.policy.grad_fn
    gone = weakref.ref(first.policy)
    del first
    gc.collect()
    assert gone() is None


def test_the_optimizer_line_states_what_adamw_builds() -> None:
    """The run prints its resolved optimizer at start (its defaults are not optax.adamw's); the
    line follows the config, and the chain steps at the stated rate (Adam's first step moves a
    parameter by lr, whatever the gradient's size)."""
    import optax

    from areal_jax.trainer.learner import adamw, describe_optimizer

    line = describe_optimizer(TrainConfig())
    assert line == ("optimizer: global-norm clipping at 1, then AdamW lr 1e-06 (constant after 0 warmup steps), "
                    "betas (0.9, 0.999), eps 1e-08, weight decay 0.01 on matrices only (train.*)")
    other = describe_optimizer(TrainConfig(lr=3e-4, grad_clip=None, weight_decay=0.0, betas=(0.8, 0.95),
                                           lr_schedule="warmup_cosine", warmup_steps=5, total_steps=50))
    assert other.startswith("optimizer: no clipping, AdamW lr 0.0003 (warmup_cosine (warmup 5, over 50")
    assert "betas (0.8, 0.95)" in other and "weight decay 0 " in other
    train = TrainConfig(lr=0.1, weight_decay=0.0)
    tx = adamw(train, optax.constant_schedule(train.lr))
    params = {"bias": jnp.ones(3)}
    updates, _ = tx.update({"bias": jnp.full(3, 1e6)}, tx.init(params), params)
    np.testing.assert_allclose(np.asarray(updates["bias"]), -0.1, rtol=1e-4)


def test_advantages_count_trained_tokens_and_see_truncation() -> None:
    """The overlong penalty measures the loss-mask count, AReaL's: a multi-turn answer's
    environment tokens (off the mask) do not make it longer. Answers cut off without EOS reach
    ``mask_no_eos_with_zero``."""
    trajs = random_trajectories(np.random.default_rng(8), 2, 4, answer_len=(10, 16))
    for t in trajs[::2]:  # environment tokens inside the answer
        t.loss_mask[t.prompt_len + 2:t.prompt_len + 8] = 0
    for t in trajs[1::3]:
        t.truncated = True
    algo = AlgoConfig(overlong_penalty=OverlongPenalty(buffer_len=4, max_len=10), mask_no_eos_with_zero=True)
    trainer = Trainer(tiny_model(), algo, TrainConfig(micro_batch_tokens=64, length_buckets=(64,)))
    got = trainer.prepare_batch(trajs, 0).advantages
    masks = np.stack([np.pad(t.loss_mask, (0, 64 - len(t))) for t in trajs])
    rewards = np.array([t.reward for t in trajs], np.float32)
    truncated = np.array([t.truncated for t in trajs])
    ref, _ = compute_advantages(algo, rewards, masks, group_size=4, truncated=truncated)
    for g, r, t in zip(got, np.asarray(ref), trajs, strict=True):
        np.testing.assert_allclose(g, r[:len(t)], rtol=1e-5, atol=1e-6)
    by_length, _ = compute_advantages(algo, rewards, masks, group_size=4, truncated=truncated,
                                      response_lengths=np.array([t.answer_len for t in trajs]))
    assert np.abs(np.asarray(by_length) - np.asarray(ref)).max() > 1e-2
    kept_eos, _ = compute_advantages(algo, rewards, masks, group_size=4)
    assert np.abs(np.asarray(kept_eos) - np.asarray(ref)).max() > 1e-2
