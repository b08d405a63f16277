"""``TrainConfig``: the trainer's room of the run config (optimizer, schedule, batching, numerics).

What the loss computes is ``AlgoConfig``'s business (including ``ppo_n_minibatches``, the number
of optimizer steps per training batch); this dataclass only says how the step is carried out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import optax

from areal_jax.data.packing import DEFAULT_BUCKETS
from areal_jax.models.config import dtype_name, remat_policy

SCHEDULES = ("constant", "warmup_cosine")
AUTO_MICRO_BATCH_TOKENS = {"cpu": 1024, "gpu": 8192, "tpu": 8192}
"""``micro_batch_tokens: auto`` by backend (8192 on any other). Measured on a CPU: see the
field's docstring."""
COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How one training batch becomes optimizer steps."""

    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    critic_lr: float | None = None
    """Peak learning rate of the critic's own AdamW (PPO, ``adv_estimator='gae'``); same schedule
    shape and other optimizer settings as the policy. None means ``lr``."""
    weight_decay: float = 0.01
    """Decoupled weight decay; applied to matrices only, never to norms or biases."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's first and second moment decay rates."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    grad_clip: float | None = 1.0
    """Clip the minibatch gradient to this global L2 norm before the update; None disables it."""
    lr_schedule: str = "constant"
    """``constant`` (after warmup) or ``warmup_cosine`` (linear warmup, cosine decay to ``min_lr_ratio``)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    total_steps: int = 0
    """Optimizer steps the cosine decay spans (warmup included); required by ``warmup_cosine``."""
    min_lr_ratio: float = 0.0
    """Final learning rate of ``warmup_cosine`` as a fraction of ``lr``."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Token budget of one packed row, i.e. of one data-parallel group's share of a micro-batch.
    ``auto``: 1024 on a CPU, 8192 on a GPU or TPU (``AUTO_MICRO_BATCH_TOKENS``), resolved when
    the trainer starts (``resolved``) and printed in the run's log. On a CPU, short rows train
    faster per token when the model is small: a 0.5M-parameter model's gradient took 63 ms on
    one row of 2,048 tokens and 9.5 ms on a row of at most 512, likely as its activations then
    stay in cache (keep ``length_buckets`` up to this budget fine as well); a GRPO step of the
    small model timed by ``benchmarks/micro_batch_tokens.py`` is in the CHANGELOG."""
    min_micro_batches: int = 1
    """Each data-parallel group runs at least this many micro-batches per minibatch (memory cap)."""
    length_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    """Row lengths a micro-batch is padded to; each is one compiled shape, so keep the set small."""
    compile_warmup: bool = False
    """Compile every step shape before the first step (``Trainer.warmup``): each length bucket up
    to ``micro_batch_tokens`` with each attention pair budget it can take. A run then never
    stops mid-way to compile a shape its answers first need, at the cost of compiling shapes it
    may never use (seconds each on a CPU; the persistent compile cache keeps them for later
    runs, though each new process still traces them)."""
    compute_dtype: Any = None
    """Activation and matmul dtype (``float32`` or ``bfloat16``, a name or the JAX/NumPy dtype);
    parameters and optimizer state stay float32 either way (master weights), and logits are
    float32. None: bfloat16 on GPU and TPU, float32 on CPU (where bfloat16 matmuls are slower)."""
    temperature: float = 1.0
    """Logprobs are ``log_softmax(logits / temperature)``; must equal the rollout's sampling temperature."""
    logprob_chunk_size: int = 1024
    """Tokens per chunk when forming logits from hidden states (bounds the ``[tokens, vocab]`` peak)."""
    max_seq_len: int | None = None
    """Longest trajectory (prompt + answer) the run produces. Packed attention then looks back at
    most this far, so a packed row of ``T`` tokens costs about ``T * max_seq_len`` instead of
    ``T ** 2``; a longer trajectory is an error. None: full attention over each row."""
    attention_block: int = 64
    """On the dense (CPU and reference) attention path, a packed row is cut into blocks of this
    many tokens and only the block pairs that hold a query and a key of one sequence are
    computed (``data.packing.attention_block_pairs``): a row of short sequences costs about
    ``sum(len ** 2) / 2`` scores instead of ``tokens * max_seq_len``. 0 computes every score
    within the window. The fused paths (cuDNN, splash) skip masked blocks themselves."""
    remat: bool | str = "auto"
    """What the backward pass keeps of each decoder layer: ``none`` (all activations), ``full``
    (only the layer input: least memory, about 1/3 more compute) or ``dots`` (also the weight
    matmuls' outputs); True / False mean ``full`` / ``none``. ``auto``: the first of ``none``,
    ``dots``, ``full`` whose step fits the device by the memory plan (``trainer/memory.py``),
    ``none`` where no device memory is known (a CPU without ``device_memory_gb``). A policy
    given by name is checked against the plan too, and a run that does not fit fails before its
    first step with the knobs to turn."""
    device_memory_gb: float | None = None
    """Memory per device (GiB) the train step may plan to use. None: 90% of the limit the device
    reports (GPU, TPU) less what is in use when the trainer starts, and no plan at all where it
    reports none (CPU). Set it on a device shared with an inference engine that allocates after
    the trainer starts (what the engine leaves), or to plan a CPU run."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.remat != "auto":
            try:
                object.__setattr__(self, "remat", remat_policy(self.remat, "remat"))
            except ValueError:
                raise ValueError(f"remat={self.remat!r}; choose auto, none, dots or full (or true / false)") from None
        if self.device_memory_gb is not None and not self.device_memory_gb > 0:
            raise ValueError(f"device_memory_gb must be positive (or null: the device's own limit), "
                             f"got {self.device_memory_gb}")
        object.__setattr__(self, "length_buckets", tuple(sorted(int(b) for b in self.length_buckets)))
        if self.attention_block < 0:
            raise ValueError(f"attention_block must be >= 0 (0: off), got {self.attention_block}")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {SCHEDULES}, got {self.lr_schedule!r}")
        if self.compute_dtype is not None:
            object.__setattr__(self, "compute_dtype", dtype_name(self.compute_dtype, "compute_dtype"))
            if self.compute_dtype not in COMPUTE_DTYPES:
                raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {self.compute_dtype!r}")
        if self.lr_schedule == "warmup_cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"lr_schedule='warmup_cosine' needs total_steps > warmup_steps, got {self.total_steps} "
                f"and {self.warmup_steps}"
            )
        if self.micro_batch_tokens != "auto" and (isinstance(self.micro_batch_tokens, bool)
                                                  or not isinstance(self.micro_batch_tokens, int)):
            raise ValueError(f"micro_batch_tokens must be a positive int or 'auto', got {self.micro_batch_tokens!r}")
        # ``auto`` is checked against the buckets once ``resolved`` has made it a number.
        budget = 1 if self.micro_batch_tokens == "auto" else self.micro_batch_tokens
        if not self.length_buckets or self.length_buckets[-1] < budget:
            raise ValueError(
                f"the largest length bucket ({max(self.length_buckets, default=0)}) must hold "
                f"micro_batch_tokens={budget}; add a bucket or lower the budget"
            )
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")
        auto = self.micro_batch_tokens == "auto"
        if self.max_seq_len is not None and not (1 <= self.max_seq_len and (auto or self.max_seq_len <= budget)):
            raise ValueError(f"max_seq_len must be in 1..micro_batch_tokens ({budget}), got {self.max_seq_len}")
        if self.min_micro_batches < 1 or budget < 1 or self.logprob_chunk_size < 1:
            raise ValueError("min_micro_batches, micro_batch_tokens and logprob_chunk_size must be >= 1")

    def resolved(self, backend: str | None = None) -> TrainConfig:
        """This config with ``micro_batch_tokens: auto`` made a number for ``backend`` (default:
        JAX's, which this call initialises, so a trainer calls it when it starts, not the
        config loader)."""
        if self.micro_batch_tokens != "auto":
            return self
        backend = backend or jax.default_backend()
        budget = AUTO_MICRO_BATCH_TOKENS.get(backend, 8192)
        try:
            return dataclasses.replace(self, micro_batch_tokens=budget)
        except ValueError as e:
            raise ValueError(f"train.micro_batch_tokens: auto is {budget} on {backend}: {e}") from None

    def resolved_compute_dtype(self, backend: str | None = None) -> str:
        """``compute_dtype``, or the default for ``backend`` (default: JAX's) when it is None."""
        if self.compute_dtype is not None:
            return self.compute_dtype
        return "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"

    def schedule(self) -> optax.Schedule:
        if self.lr_schedule == "warmup_cosine":
            return optax.warmup_cosine_decay_schedule(
                init_value=0.0, peak_value=self.lr, warmup_steps=self.warmup_steps,
                decay_steps=self.total_steps, end_value=self.lr * self.min_lr_ratio,
            )
        if self.warmup_steps:
            return optax.join_schedules(
                [optax.linear_schedule(0.0, self.lr, self.warmup_steps), optax.constant_schedule(self.lr)],
                [self.warmup_steps],
            )
        return optax.constant_schedule(self.lr)
