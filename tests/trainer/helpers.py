"""Shared test helpers: a tiny decoder, random trajectories, and a small KV-cache sampler.

The sampler stands in for the inference engine: it draws answers from the trainer's current
weights and reports ``log_softmax(logits / T)`` logprobs, the rollout side's convention.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.algo import AlgoConfig, compute_advantages
from areal_jax.data.trajectory import Trajectory
from areal_jax.models import Decoder, ModelConfig

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)


def tiny_model(seed: int = 0, **overrides) -> Decoder:
    return Decoder(TINY.replace(**overrides), rngs=nnx.Rngs(seed))


def random_trajectories(
    rng: np.random.Generator,
    num_groups: int,
    group_size: int,
    *,
    prompt_len: tuple[int, int] = (3, 10),
    answer_len: tuple[int, int] = (2, 16),
    version: int | Callable[[np.random.Generator], int] = 0,
) -> list[Trajectory]:
    """Groups of answers with random tokens, rewards and behavior logprobs near a model's scale."""
    out = []
    for g in range(num_groups):
        p = int(rng.integers(*prompt_len))
        prompt = rng.integers(0, 128, p)
        for _ in range(group_size):
            a = int(rng.integers(*answer_len))
            v = version(rng) if callable(version) else version
            out.append(Trajectory.from_prompt_and_answer(
                prompt, rng.integers(0, 128, a), -rng.uniform(4.0, 5.5, a), v,
                reward=float(rng.random()), group_id=g))
    return out


def make_sampler(graphdef: nnx.GraphDef, prompt_len: int, answer_len: int,
                 temperature: float = 1.0) -> Callable:
    """``sample(params, prompts [b, prompt_len], key) -> (tokens, logprobs)``, both ``[b, answer_len]``."""
    total = prompt_len + answer_len

    @jax.jit
    def sample(params: nnx.State, prompts: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = nnx.merge(graphdef, params)
        b = prompts.shape[0]
        cache = model.init_cache(b, total)
        positions = jnp.broadcast_to(jnp.arange(prompt_len), (b, prompt_len))
        logits, cache = model.decode(prompts, positions, cache, kv_len=total)

        def step(carry, t):
            last, cache, key = carry
            key, sub = jax.random.split(key)
            scaled = last / temperature
            tok = jax.random.categorical(sub, scaled)
            lp = jnp.take_along_axis(jax.nn.log_softmax(scaled), tok[:, None], axis=1)[:, 0]
            logits, cache = model.decode(tok[:, None], jnp.full((b, 1), prompt_len + t), cache, kv_len=total)
            return (logits[:, 0], cache, key), (tok, lp)

        _, (toks, lps) = jax.lax.scan(step, (logits[:, -1], cache, key), jnp.arange(answer_len))
        return toks.T, lps.T

    return sample


NO_EVAL = ["data.eval_size=0"]
"""Overrides for a run whose test reads nothing of the held-out evaluation: its calls of a prompt
or a few meet engine shapes that no training step does, each traced and compiled for the
evaluations alone."""


def assert_every_version_served(metrics: list[dict], servers: int = 1) -> None:
    """Each step made a new version and every server took it. In async mode a version's push
    overlaps the next batch, so a step's record may still show the version before on a server;
    a step that evaluated (the last one always does) waited for its push, so it shows its own.
    Before the first push a server reports its own label for the weights it started with."""
    assert [m["version"] for m in metrics] == list(range(1, len(metrics) + 1))
    for m in metrics:
        v = m["version"]
        before = {"0", "default"} if v == 1 else {str(v - 1)}
        want = {str(v)} if m.get("eval_accuracy") is not None else before | {str(v)}
        assert len(m["served_versions"]) == servers and set(m["served_versions"]) <= want, \
            (m["step"], m["served_versions"])
    assert metrics[-1].get("eval_accuracy") is not None


def padded_advantages(
    algo: AlgoConfig, trajectories: Sequence[Trajectory], token_kl: Sequence[np.ndarray] | None = None,
    values: Sequence[np.ndarray] | None = None, last_values: Sequence[float] | None = None, width: int = 256,
) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """The trainer's advantages by the layout it used before it computed them on its packed rows,
    kept as the reference: trajectories sorted by group, one per row right-padded to ``width``,
    in the index-``i`` convention (``token_kl``, ``values`` per trajectory the same way;
    ``last_values``: the critic's value after each whole answer), ``compute_advantages`` on that
    block, unpadded. Returns per-trajectory advantages and returns (None without a critic)."""
    order = sorted(range(len(trajectories)), key=lambda i: (trajectories[i].group_id, i))
    group_size = Counter(t.group_id for t in trajectories)[trajectories[0].group_id]
    pad = lambda x: np.pad(np.asarray(x, np.float32), (0, width - len(x)))
    stack = lambda xs: None if xs is None else np.stack([pad(xs[i]) for i in order])
    boot = {} if last_values is None else {"last_values": np.array([last_values[i] for i in order], np.float32)}
    adv, ret = compute_advantages(
        algo, np.array([trajectories[i].reward for i in order], np.float32), stack([t.loss_mask for t in trajectories]),
        group_size=group_size, token_kl=stack(token_kl), values=stack(values),
        truncated=np.array([trajectories[i].truncated for i in order]), **boot)

    def unpad(x: Any) -> list[np.ndarray] | None:
        if x is None:
            return None
        out: list[np.ndarray] = [np.zeros(0)] * len(trajectories)
        for row, i in enumerate(order):
            out[i] = np.asarray(x)[row, :len(trajectories[i])]
        return out

    return unpad(adv), unpad(ret)
