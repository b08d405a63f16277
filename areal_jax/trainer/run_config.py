"""``RunConfig``: one RL run, composed of every room's config; what ``areal-jax train --config``
reads (YAML overriding these defaults, then ``key=value`` overrides)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from areal_jax import CACHE_ROOT
from areal_jax.algo import AlgoConfig
from areal_jax.config import load_config
from areal_jax.controller.config import RolloutConfig
from areal_jax.data import DatasetConfig
from areal_jax.rewards import RewardConfig
from areal_jax.trainer.checkpoint import CheckpointConfig
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.metrics import LogConfig
from areal_jax.trainer.sft import SFTConfig
from sharding import DistributedConfig, MeshConfig


@dataclass
class ModelSource:
    """The policy to start from: a HF model directory, or a tiny model the project builds."""

    path: str | None = None
    """HF model directory (config.json, safetensors, tokenizer files)."""
    tiny: str | None = None
    """Build a tiny random model of this size (``tiny``, ``small``, ...) with the project's
    character tokenizer in ``<run dir>/base`` instead of loading ``path``; with ``tiny_options``
    and no ``path``, ``tiny`` (the size then fills in the shapes the options leave out)."""
    tiny_options: dict[str, Any] = field(default_factory=dict)
    """Overrides of the tiny model's config (``hidden_size``, ``num_hidden_layers``, ...); with
    ``path`` they do nothing, and the run's log says so at start (``RunConfig.advisories``)."""
    model_type: Literal["qwen2", "qwen3", "llama"] = "qwen2"
    """Architecture of a tiny model: ``qwen2``, ``qwen3`` or ``llama``."""
    dtype: str | None = None
    """Parameter/compute dtype override (``float32``, ``bfloat16``; a JAX/NumPy dtype is stored as
    its name); None: the checkpoint's."""
    attention_impl: str = "auto"
    """The trainer's attention over packed rows: ``auto`` (fused on GPU/TPU in bfloat16, dense
    elsewhere), ``dense`` (the reference), ``dot_product`` (cuDNN flash attention on GPU) or
    ``splash`` (Pallas, TPU); see ``ModelConfig.attention_impl``. On an H200, ``auto`` trained a
    494M model 1.49x faster than ``dense`` with logprobs as close to float32 (docs/results.md)."""

    def __post_init__(self) -> None:
        if self.path is None and self.tiny is None and self.tiny_options:
            self.tiny = "tiny"  # shapes given: the size only fills in the ones not set
        if (self.path is None) == (self.tiny is None):
            raise ValueError("model: set exactly one of model.path (a HF model directory) or model.tiny (a size)")
        from areal_jax.models.config import ATTENTION_IMPLS, dtype_name

        self._check_tiny()
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"model.attention_impl={self.attention_impl!r}: choose one of {list(ATTENTION_IMPLS)}")
        # A name, not a dtype object: the run's config.yaml is written with yaml.safe_dump.
        if self.dtype is not None:
            self.dtype = dtype_name(self.dtype, "model.dtype")


    def _check_tiny(self) -> None:
        """``tiny`` names a size and ``tiny_options`` are the tiny model's config fields, each of
        its type: a bad one otherwise surfaced as a JAX traceback when the model was built."""
        if self.tiny is None:
            return
        import typing

        from areal_jax.config import check_options
        from areal_jax.models.config import ModelConfig
        from areal_jax.models.tiny import TINY_OPTIONS_SET_BY_BUILDER, TINY_SIZES

        if self.tiny not in TINY_SIZES:
            raise ValueError(f"model.tiny={self.tiny!r}: choose one of {list(TINY_SIZES)} (tiny_options then "
                             "override its shapes)")
        hints = typing.get_type_hints(ModelConfig)
        schema = {f.name: hints[f.name] for f in dataclasses.fields(ModelConfig)
                  if f.init and f.name not in TINY_OPTIONS_SET_BY_BUILDER}
        self.tiny_options = check_options(self.tiny_options, schema, "model.tiny_options",
                                          owner=f"a tiny {self.model_type} model")


@dataclass
class EvalConfig:
    """Held-out evaluation during and after the run."""

    every: int = 0
    """Evaluate every this many steps (and after the warm start and the last step); 0: only then."""
    max_prompts: int | None = None
    """Evaluate on at most this many held-out prompts (None: all)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    max_new_tokens: int | None = None
    """None: the rollout's ``max_new_tokens``."""
    correct_threshold: float = 1.0
    """An answer counts as correct when its reward is at least this."""


STALE_ONE_STEP = 4
"""The ``max_staleness`` from which ``RunConfig.advisories`` warns about decoupled PPO with one
optimizer step per batch (at 4 it lost 7 points on the benchmark task, at 8 it collapsed)."""
STALE_ONE_STEP_LR = 3e-4
"""The learning rate above which ``RunConfig.advisories`` warns about decoupled PPO with one
optimizer step per batch at any staleness: on a random-init 4-layer model, asynchronous runs with
nearly every sample one version stale climbed to reward 1 and then fell to 0 at lr 1e-3 (to 0.31
with a gradient clip of 1), and held at 3e-4 (docs/stale-one-step.md). A floor, not a safe value:
larger models overshoot at smaller rates (AReaL's GRPO recipe trains with one minibatch at 1.7e-5
and clips gradients at 1)."""


@dataclass
class RunConfig:
    """Everything one ``areal-jax train`` run needs."""

    run_dir: str = "runs/default"
    """Metrics, TensorBoard events, plots, logs, weights and the exported policy go here: a local
    directory (shared by every host of a multi-host run) or a URL such as ``gs://bucket/runs/r1``
    (any fsspec scheme; hosts need no shared filesystem: see ``trainer/run_dir.py``)."""
    local_dir: str | None = None
    """With a URL ``run_dir``: this host's working directory (server logs, the base model, disk
    weight pushes, the files uploaded to ``run_dir``); None: ``~/.cache/areal-jax/runs/<name>``.
    Ignored for a local ``run_dir``."""
    steps: int = 100
    """Training steps (policy versions) of RL. 0: the warm start and the held-out evaluation before
    RL only; nothing of a step is compiled or generated."""
    seed: int = 0
    """Seed of the tiny model's weights and of the host-side random draws."""
    model: ModelSource = field(default_factory=lambda: ModelSource(tiny="tiny"))
    data: DatasetConfig = field(default_factory=DatasetConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    batch_size: int = 8
    """Groups (prompts) per training step."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """The trainer's device mesh; in a multi-process run it spans every process's devices."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """Multi-host training: how this process joins the others (each host runs the same command).
    Process 0 owns rollout, the controller, evaluation and the metrics, and hands each step's
    batch to the others; the run directory is shared storage or a URL (``gs://``)."""
    warm_start: SFTConfig | None = None
    """A supervised warm start on the task's own examples before RL (None: none)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """When the run saves itself for ``--resume`` (orbax), and where."""
    export: bool = True
    """Save the final policy as a HF model directory in ``<run dir>/final`` (a URL run directory:
    written there by every process, each its own shards)."""
    compile_cache: str | None = f"{CACHE_ROOT}/jax"
    """JAX's persistent compilation cache, for the trainer and the rollout servers it starts: a
    run compiles its train step and the servers' prefill and decode shapes once, and the runs
    after it load them (``JAX_COMPILATION_CACHE_DIR``, when set, wins; None: no cache)."""

    def __post_init__(self) -> None:
        self._check_combinations()
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 group, got {self.batch_size}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if abs(self.train.temperature - self.rollout.temperature) > 1e-9 and self.rollout.temperature > 0:
            raise ValueError(f"train.temperature ({self.train.temperature}) must equal rollout.temperature "
                             f"({self.rollout.temperature}): the trainer's logprobs must match the sampler's")
        penalty = self.algo.overlong_penalty
        if penalty is not None and penalty.max_len is None:
            # DAPO's soft punishment ends at the generation limit, as AReaL's follows max_new_tokens.
            if penalty.buffer_len > self.rollout.max_new_tokens:
                raise ValueError(f"algo.overlong_penalty.buffer_len ({penalty.buffer_len}) exceeds "
                                 f"rollout.max_new_tokens ({self.rollout.max_new_tokens}), where the penalty "
                                 f"ends; lower buffer_len or set overlong_penalty.max_len")
            self.algo = replace(self.algo, overlong_penalty=replace(penalty, max_len=self.rollout.max_new_tokens))

    def _check_combinations(self) -> None:
        """Settings of different sections that cannot work together."""
        if not self.data.apply_chat_template and self.rollout.workflow in ("multi_turn", "agentic"):
            raise ValueError(f"rollout.workflow={self.rollout.workflow} renders its conversation with the chat "
                             "template; data.apply_chat_template=false gives raw prompts without one. Use "
                             "single_turn (or your own workflow) for raw prompts")

    def advisories(self) -> list[str]:
        """Settings that are valid but known to train badly, or that have no effect, each with
        the fix; the run writes them to its log at start."""
        out = []
        eta = self.rollout.effective_max_staleness
        one_step = (self.algo.use_decoupled_loss and self.algo.ppo_n_minibatches == 1
                    and self.algo.m2_threshold is None)
        if one_step and eta >= STALE_ONE_STEP:
            out.append(
                f"algo.ppo_n_minibatches is 1 with the decoupled loss at rollout.max_staleness {eta}: with one "
                "optimizer step per batch the proximal policy is the current one, so the clip never binds and "
                "nothing bounds how far stale data moves the policy (docs/results.md, staleness ablation). "
                "Set algo.ppo_n_minibatches >= 2, or lower rollout.max_staleness")
        elif one_step and eta >= 1 and self.train.lr > STALE_ONE_STEP_LR:
            out.append(
                f"train.lr {self.train.lr:g} with algo.ppo_n_minibatches 1 and the decoupled loss at "
                f"rollout.max_staleness {eta}: when rollout keeps ahead of the trainer every trained sample is "
                "stale, and with one optimizer step per batch the PPO clip never binds (the proximal policy is "
                "the current one), so only the learning rate bounds how far each step moves the policy on that "
                "data; a small model at this rate climbed to full reward and then collapsed (docs/stale-one-step.md). "
                "A gradient clip did not prevent it (Adam scales its steps to the learning rate). Lower train.lr "
                "(AReaL's recipes: about 1e-5 with one minibatch), or set algo.ppo_n_minibatches >= 2 (the clip "
                "binds from the second minibatch on), or algo.m2_threshold (M2PO's trust region, e.g. 0.04), or "
                "rollout.max_staleness 0")
        if self.model.path is not None and self.model.tiny_options:
            out.append(
                f"model.tiny_options {sorted(self.model.tiny_options)} are ignored: model.path is set, and its "
                "config.json gives the model's shapes. Remove them (model.tiny_options={} on the command line), "
                "or build a tiny model with model.tiny instead of model.path")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_run_config(path: str | Path | Sequence[str | Path] | None = None,
                    overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML file (or files, merged in order; each with its ``include:`` files
    under it), then ``key=value`` overrides; unknown keys and wrong types fail here, before
    anything starts."""
    return load_config(RunConfig, path, overrides)


def check_imports(cfg: RunConfig) -> None:
    """Import what the config names (the workflow, an agent, the reward function) now, so a
    misspelt module fails before any server or model starts. Raises ``ConfigError``."""
    from areal_jax.config import ConfigError
    from areal_jax.controller.workflow import WorkflowError, get_workflow, resolve_callable
    from areal_jax.rewards import get_reward_fn

    try:
        get_workflow(cfg.rollout.workflow)
        if cfg.rollout.workflow == "agentic":
            resolve_callable(str(cfg.rollout.workflow_options["agent"]), "rollout.workflow_options.agent")
        get_reward_fn(cfg.reward.name)
    except (WorkflowError, ValueError) as e:
        raise ConfigError(str(e)) from None
