"""The benchmark's tasks: the run configs of the async, interrupt and staleness parts, the
warm-started checkpoint each invocation starts from (made once, or the shipped one), and the
run config of one mode of one part.

The async and interrupt parts' task is the demo's one-digit addition with a scratch pad of
long-tailed length: the warm start teaches answers of the form ``"." * k + "\n" + sum`` with
``k`` drawn from a lognormal (``SCRATCH``: median 6, clipped at 80), and the reward reads the last
line (``--long-tail``'s scratch pad writes the sum out again instead of dots, with a longer tail).
The policy then samples its own scratch lengths, most short and a few long, as reasoning models
do, so a synchronous step waits for its longest answer while most slots sit finished. Held-out
accuracy samples at the policy's temperature (1): greedy decoding on this task writes dots to the
token limit (every scratch position's likeliest next token is another dot).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np

SCRATCH: dict[str, Any] = {"median": 6, "sigma": 1.0, "max": 80, "unit": "."}
"""``TASK``'s warm-start scratch pad: ``unit`` repeated k times, k lognormal (median, sigma of its
log), clipped at max."""
LONG_TAIL_SCRATCH: dict[str, Any] = {"median": 2, "sigma": 1.5, "max": 50, "unit": "echo"}
"""``LONG_TAIL_TASK``'s: the sum itself written out again k times (``"3+5;"``), so the answer
reads its operands from the line just before it and not across hundreds of dots (a warm start
on dots that long reached 5% and RL did not move it)."""

TASK: dict[str, Any] = {
    "batch_size": 8,
    "data": {"source": "reasoning_gym", "task": "basic_arithmetic", "size": 4000, "seed": 0, "eval_size": 100,
             "task_options": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                              "allow_parentheses": False, "allow_negation": False}},
    "model": {"tiny": "tiny", "tiny_options": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                                               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}},
    "reward": {"name": "reasoning_gym", "num_workers": 1},
    "warm_start": {"steps": 400, "batch_size": 64, "lr": 0.003, "max_len": 128},
    # DAPO's dynamic sampling, as AReaL's reasoning recipes run it: a group whose answers all score
    # the same teaches GRPO nothing and is dropped, so rollout generates more than is trained.
    "rollout": {"group_size": 8, "max_new_tokens": 96, "temperature": 1.0, "filter_uniform_reward": True,
                "server_args": ["--max-running-requests", "128", "--context-length", "160", "--server-warmup"]},
    "algo": {"adv_estimator": "grpo"},
    "train": {"lr": 0.0003, "micro_batch_tokens": 2048, "length_buckets": [2048], "max_seq_len": 160},
    "eval": {"every": 10, "temperature": 1.0},
    "export": False,
}
"""The async and interrupt parts' run config (a dict in ``RunConfig``'s shape) before
``model.path`` is set: the scratch-pad task (long-tailed answers), warm-started to about 16%.
Its server compiles every step shape before the run (``--server-warmup``), as a long run's
servers have compiled them by its steady state: compiled on first use instead, a new shape
stalled a weight update's pause for about 1.2 s on the rollout core, several times a run."""

LONG_TAIL_TASK: dict[str, Any] = {
    **TASK,
    "data": {**TASK["data"], "eval_size": 400},
    "warm_start": {**TASK["warm_start"], "max_len": 300},
    "rollout": {**TASK["rollout"], "max_new_tokens": 448,
                "server_args": ["--max-running-requests", "128", "--context-length", "512", "--server-warmup"]},
    "algo": {**TASK["algo"], "ppo_n_minibatches": 2},
    "train": {**TASK["train"], "max_seq_len": 512, "lr": 1e-4, "compile_warmup": True,
              "micro_batch_tokens": 512, "length_buckets": [256, 384, 512]},
}
"""``areal-jax bench --long-tail``: the regime of AReaL's long reasoning answers, where generation
is most of a synchronous step. The echoed scratch pad (``LONG_TAIL_SCRATCH``) under RL grows a
tail to the 448-token limit against a mean near 100, so a synchronous step waits on a few long
answers decoding at low concurrency. Two optimizer steps per batch, as ``RunConfig.advisories``
asks of decoupled PPO at ``max_staleness`` 4. Warm-started to about 20% (temperature 1); 400
held-out prompts, so that a few points of learning stand out of the noise. Learning rate 1e-4, a
third of ``TASK``'s: at 3e-4 synchronous RL stalled near 34% after 10 steps and each policy
version moved the trained tokens' KL by 0.015-0.08, far from the small steps of RL on real
models; at 1e-4 both synchronous and asynchronous runs end about 9-12 points higher. The trainer
compiles its step shapes before the first step (``train.compile_warmup``), as the server does:
otherwise a fresh trainer process compiled 0.04 s a step, on average, inside the timed steps of a
30-step run, as the answers grew into new attention pair budgets. Rows of 512 tokens (the longest
trajectory), padded to 256, 384 or 512: a minibatch of about 1,650 tokens trains as three or four
short rows, not one row of 2,048, and replayed on one core the bench's own batches trained in
0.104 s a step against 0.173 s (2026-11-27, CHANGELOG; docs/results/mb512_2026-11-27)."""

DEMO_TASK: dict[str, Any] = {
    "batch_size": 16,
    "data": {**TASK["data"], "eval_size": 200},
    "model": TASK["model"],
    "reward": {"name": "reasoning_gym", "num_workers": 1},
    "warm_start": {"steps": 190, "batch_size": 64, "lr": 0.003, "max_len": 40},
    "rollout": {"group_size": 8, "max_new_tokens": 8, "temperature": 1.0,
                "server_args": ["--max-running-requests", "128", "--context-length", "128"]},
    "algo": {"adv_estimator": "grpo"},
    "train": {"lr": 0.0003, "micro_batch_tokens": 4096, "length_buckets": [4096], "max_seq_len": 128},
    "eval": {"every": 0},
    "export": False,
}
"""The staleness ablation's run config (``--quick`` runs the ablation on ``TASK`` instead, with
the async part's warm start and server): ``configs/demo.yaml``'s task (one-digit sums answered at
once, greedy held-out accuracy), which RL moves from about 40% to 80% in 100 steps: enough
learning in a short run for staleness to show in it."""


STEPS = 30
"""RL steps per run of the async and interrupt parts (``--steps`` sets another count)."""


def warmup_steps(quick: bool) -> int:
    """Steps at the start of each async or interrupt run that compile and are left out of its figures."""
    return 1 if quick else 3


def run_steps(quick: bool, steps: int | None = None) -> tuple[int, int]:
    """``(steps, warm-up steps)`` of each async or interrupt run: ``steps`` when given, else
    ``STEPS`` (4 with ``quick``)."""
    return steps or (4 if quick else STEPS), warmup_steps(quick)


def task_config(quick: bool, task: dict[str, Any] | None = None) -> dict[str, Any]:
    """``task`` (default ``TASK``), smaller with ``quick`` (shorter warm start, fewer held-out
    prompts, smaller batches)."""
    cfg = copy.deepcopy(TASK if task is None else task)
    if quick:
        cfg["warm_start"].update(steps=10, batch_size=16)
        cfg["data"].update(size=300, eval_size=16)
        cfg["rollout"].update(group_size=4, max_new_tokens=min(32, cfg["rollout"]["max_new_tokens"]),
                              filter_uniform_reward=False)
        cfg["eval"]["every"] = 0
        cfg["batch_size"] = 2
        # Few steps, none of them timed closely: compiling every server shape would be most of it,
        # at start-up or in the background (a paged server started without its warm-up compiles the
        # rest meanwhile: about 4.7 of a quick server's 7.7 CPU-seconds even from a warm cache), so
        # each shape compiles at its first call and the shapes no request meets never do.
        cfg["rollout"]["server_args"] = [a for a in cfg["rollout"]["server_args"] if a != "--server-warmup"]
        cfg["rollout"]["server_args"] += ["--compile-threads", "0"]
    return cfg


def scratch_examples(rows: list[Any], tokenizer: Any, seed: int,
                     scratch: dict[str, Any] = SCRATCH) -> list[tuple[list[int], list[int]]]:
    """Warm-start pairs ``(prompt_ids, unit * k + "\n" + answer + eos)``, ``k`` drawn as
    ``scratch`` says; the unit ``"echo"`` is the row's expression without spaces and a ``;``."""
    from areal_jax.trainer.sft import reference_answer

    rng = np.random.default_rng(seed)
    ks = np.minimum(rng.lognormal(np.log(scratch["median"]), scratch["sigma"], len(rows)).astype(int), scratch["max"])
    out = []
    for r, k in zip(rows, ks, strict=True):
        text = _unit(r, scratch.get("unit", ".")) * int(k) + "\n" + reference_answer(r)
        out.append((list(r.prompt_ids), [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]))
    return out


def _unit(row: Any, unit: str) -> str:
    if unit != "echo":
        return unit
    try:
        return str(row.reward_fields["entry"]["metadata"]["expression"]).replace(" ", "") + ";"
    except KeyError as e:
        raise ValueError(f"row {row.id}: an echoed scratch pad needs a reasoning-gym entry with "
                         "metadata.expression (basic_arithmetic's rows have it)") from e


def warm_checkpoint(cfg: dict[str, Any], out_dir: Path, *, scratch: dict[str, Any] | None = SCRATCH) -> Path:
    """Build the tiny model, run the warm start once (on ``scratch_examples`` drawn as ``scratch``
    says, or with ``scratch`` None on the task's own reference answers) and save it; every run of
    the invocation that uses ``cfg`` starts from this directory (``<out_dir>/warm_start``, reused when present)."""
    from areal_jax.config import from_dict
    from areal_jax.data import load_prompts
    from areal_jax.models import load_pretrained, load_tokenizer, save_pretrained
    from areal_jax.trainer.model_dirs import prepare_model_dir
    from areal_jax.trainer.run_config import RunConfig
    from areal_jax.trainer.sft import warm_start

    target = out_dir / "warm_start"
    if (target / "config.json").exists():
        return target
    run = from_dict(RunConfig, {**cfg, "run_dir": str(out_dir)})
    base = prepare_model_dir(run, out_dir)
    tokenizer = load_tokenizer(base)
    model = load_pretrained(base)
    rows = load_prompts(run.data, tokenizer).train_rows
    examples = None
    if scratch is not None:
        examples = [e for e in scratch_examples(rows, tokenizer, run.seed, scratch)
                    if len(e[0]) + len(e[1]) <= run.warm_start.max_len]
    warm_start(model, run.warm_start, tokenizer, rows, examples=examples, train=run.train)
    return Path(save_pretrained(model, target, tokenizer_dir=base))


SHIPPED_WARM_STARTS = Path(__file__).parent / "warm_starts"
"""Warm starts that ship with the package, one folder each (a HF checkpoint and a README saying
how it was made)."""


def shipped_warm_start(name: str, out_dir: Path) -> Path:
    """Copy the shipped warm start ``name`` (``SHIPPED_WARM_STARTS / name``) to
    ``<out_dir>/warm_start`` and return that path; a copy already there is checked and reused.

    Why ship one: a warm start at a constant learning rate ends wherever its last batches put it,
    so the same 400 steps land elsewhere when rounding changes. Rebuilt with the decoder as it
    computes since 2026-11-25 (the same maths, another summation order), the long-tail warm start
    evaluated 10.5-10.8% instead of 21.75%, and 30 RL steps moved it 0-4 points instead of about 20.
    Benchmarks compare runs from one fixed checkpoint, as RL papers start from one released model."""
    import filecmp
    import shutil

    source = SHIPPED_WARM_STARTS / name
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"no shipped warm start {name!r} in {SHIPPED_WARM_STARTS}")
    target = out_dir / "warm_start"
    files = sorted(p.name for p in source.iterdir() if p.is_file() and p.name != "README.md")
    if target.exists():
        _, differ, missing = filecmp.cmpfiles(source, target, files, shallow=False)
        if differ or missing:
            raise FileExistsError(f"{target} holds another checkpoint ({differ + missing} differ from the shipped "
                                  f"{name!r}): give a new --out, or --warm-start build to train one")
        return target
    target.mkdir(parents=True)
    for f in files:
        shutil.copyfile(source / f, target / f)
    return target


def run_config(task: dict[str, Any], checkpoint: Path, run_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A run of ``task`` from ``checkpoint``; ``overrides`` are dotted keys (``rollout.mode``), and
    a key ending in ``+`` extends the list there (``rollout.server_args+``)."""
    cfg = copy.deepcopy(task)
    cfg.pop("warm_start", None)
    cfg["model"] = {"path": str(checkpoint)}
    cfg["run_dir"] = str(run_dir)
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if leaf.endswith("+"):
            node[leaf[:-1]] = [*node.get(leaf[:-1], []), *value]
        else:
            node[leaf] = value
    return cfg
