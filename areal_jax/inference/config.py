"""The engine's sizes and scheduling knobs, and the bucket sets its compiled shapes come from."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from areal_jax.models.config import dtype_name


def powers_of_two(lo: int, hi: int) -> list[int]:
    """``lo, 2 lo, 4 lo, ...`` below ``hi``."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return out


def default_prefill_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two from 16 and one and a half times each from 32 (16, 32, 48, 64, 96, 128, 192,
    ...), capped by ``max_seq_len`` (which is always the last bucket): a row pads by at most a
    third, not a half. Answers sent again after a pause have every length; under that load one
    rollout core made 1.09-1.14x the tokens/s with these buckets against powers of two alone."""
    twos = powers_of_two(16, max_seq_len)
    return tuple(sorted({*twos, *(b * 3 // 2 for b in twos[1:] if b * 3 // 2 < max_seq_len), max_seq_len}))


def default_kv_buckets(max_seq_len: int) -> tuple[int, ...]:
    """Powers of two up to a stride of ``max_seq_len / 8``, then multiples of that stride.

    Attention cost follows the attended length, so the stride keeps the waste under 1/8 of the
    cache for long sequences while the count stays around ten.
    """
    stride = max(16, -(-max_seq_len // 8 // 16) * 16)
    small = powers_of_two(16, stride)
    return tuple(sorted({*small, *range(stride, max_seq_len, stride), max_seq_len}))


KV_CACHE_ENV = "AREAL_JAX_KV_CACHE"
"""Environment variable naming the default ``EngineConfig.kv_cache`` (run a suite on either path)."""


def default_kv_cache() -> str:
    """``EngineConfig.kv_cache`` when none is given: ``$AREAL_JAX_KV_CACHE``, else ``"paged"``."""
    return os.environ.get(KV_CACHE_ENV) or "paged"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class EngineConfig:
    """Sizes and scheduling knobs of one engine."""

    num_slots: int = 32
    """KV slots = most requests decoded at once, over all lanes."""
    max_seq_len: int = 1024
    """Prompt plus output tokens per request; the KV cache holds this many positions per slot."""
    prefill_buckets: tuple[int, ...] | None = None
    """Padded prompt lengths a prefill compiles for; None derives them from ``max_seq_len``."""
    kv_buckets: tuple[int, ...] | None = None
    """Attended lengths a decode chunk compiles for; None derives them from ``max_seq_len``."""
    max_prefill_batch: int = 8
    """Slot engine: most prompts prefilled in one call; rows are padded to a power of two up to
    this. The paged engine packs by tokens instead (``chunked_prefill_size``)."""
    max_prefill_tokens: int = 8192
    """Most padded tokens (rows x bucket) in one prefill call; one prompt always fits."""
    share_prompts: bool = True
    """Requests admitted together with the same tokens (a GRPO group's answers to one prompt)
    are prefilled once: the other requests get a copy of its keys and values and sample their
    first token in the next decode chunk, so a group of ``n`` costs one prompt's prefill instead
    of ``n``. Sampling is unchanged (each request keeps its own random stream). False prefills
    every request (SGLang's ``--disable-radix-cache``)."""
    decode_steps: int = 8
    """Most tokens per decode call (a loop on device). More amortises dispatch and host sync."""
    end_chunk_at_finish: bool = True
    """While requests wait for a slot, end a decode chunk after the step at which a running
    request stops (stop token or length), so its slot takes a waiting request at once instead of
    idling to the chunk's end. False: every chunk runs ``decode_steps``."""
    lanes: int | None = None
    """Groups of slots, each with its own cache, stepped concurrently from its own thread; the
    compiled steps are shared (all lanes have ``num_slots / lanes`` rows). On a multi-core CPU,
    two half-width batches keep the cores busier than one full-width batch (small matmuls scale
    badly across threads), and one lane's host bookkeeping overlaps the other's compute. None
    picks 2 on a CPU backend with at least 2 usable cores, no mesh and an even ``num_slots`` of
    at least 4, else 1 (on 2 cores, 2 lanes beat 1 at 8, 32 and 64 slots, and 4 lanes lose to
    2). More than one lane needs ``mesh=None``."""
    seed: int | None = None
    """Seed of requests that bring none (each gets its own stream from a request counter). None
    draws one at random when the engine starts, as SGLang does without ``--random-seed``, so two
    servers started alike do not return the same samples; a request's ``seed`` still reproduces."""
    max_queued_requests: int | None = None
    """Most requests waiting for a slot; one more is refused (``QueueFullError``, HTTP 503 at the
    server). None: unbounded."""
    chunked_prefill_size: int = 1024
    """Prompt tokens per prefill call (SGLang's ``--chunked-prefill-size``); a longer prompt is
    prefilled alone in chunks of this size, so its attention scores take ``chunk x context``
    memory instead of ``context ** 2``. -1 disables chunking."""
    cache_dtype: str | None = None
    """KV cache dtype (a name or a JAX/NumPy dtype, stored as its name); None uses the model's
    compute dtype."""
    max_top_logprobs: int = 20
    """Most ``top_logprobs_num`` a request may ask for: every step computes this many top
    logprobs when some running request wants any."""
    kv_cache: str = field(default_factory=lambda: default_kv_cache())
    """``"paged"`` (the default, unless ``AREAL_JAX_KV_CACHE`` names another; ``inference.paged``):
    one pool of ``page_size``-token pages shared by all requests, admission by free pages, at
    most ``num_slots`` requests running (SGLang's ``--max-running-requests``), ``max_seq_len`` the
    context length of one request. ``"slots"``: every one of ``num_slots`` slots owns
    ``max_seq_len`` positions of KV cache (the engine before the page pool; what a mesh with a
    data axis > 1 still needs, see ``rollout_bridge.serve.engine_config``)."""
    page_size: int = 16
    """Paged: tokens per KV page (SGLang's ``--page-size``)."""
    max_total_tokens: int | None = None
    """Paged: tokens the KV pool holds (SGLang's ``--max-total-tokens``); with
    ``mem_fraction_static`` it caps the size the memory allows. None: sized from memory, never
    more than ``num_slots * max_seq_len`` (every running request at full context)."""
    attention_backend: str = "auto"
    """Paged: the paged attention implementation (sglang-jax's ``--attention-backend``, see
    ``models.paged_kernels``): ``native``, the XLA gather path (runs everywhere; the reference);
    ``fa``, the maintained kernel (TPU ragged paged attention; Pallas GPU paged attention for
    decode rows); ``auto``, ``fa`` where its constraints hold (TPU or GPU, bfloat16/float16,
    head_dim and page size the kernel tiles, one device), else ``native``. An explicit ``fa``
    that cannot run is an error at start."""
    layer_layout: str = "split"
    """How the served weights hold the decoder's layer parameters (``models.layer_stack``):
    ``split``, one array per layer, which decode reads in place; ``stacked``, the trainer's one
    array per parameter, which an in-process trainer can lend without a copy when its dtype and
    layout match, at the price of slicing (on a GPU, copying) every layer's weights out of the
    stack at each decode step."""
    mem_fraction_static: float | None = None
    """Paged: share of the device's memory that weights and the KV pool may take (SGLang's
    ``--mem-fraction-static``); None: 0.85 on a device that reports its memory. On a CPU (no
    device memory to profile) the pool takes at most this share (default 0.25) of the host's
    available memory."""
    compile_threads: int = 0
    """Paged: worker threads that, from ``start()``, compile the step shapes not compiled yet
    (``warmup`` compiles them all before it) while the engine serves, those the first requests
    need first; a step waits for its shape's compile rather than compiling it again
    (``inference.paged_compiles``). 0: none, each shape compiles at its first call, one after
    another while every request waits. (``areal-jax serve --compile-threads``; default there:
    one per two cores, at most 8.)"""

    def __post_init__(self) -> None:
        if self.cache_dtype is not None:  # a name, as every config stores dtypes (hashable, serialisable)
            self.cache_dtype = dtype_name(self.cache_dtype, "cache_dtype")
        self.prefill_buckets = tuple(sorted(self.prefill_buckets or default_prefill_buckets(self.max_seq_len)))
        self.kv_buckets = tuple(sorted(self.kv_buckets or default_kv_buckets(self.max_seq_len)))
        if self.prefill_buckets[-1] > self.max_seq_len or self.kv_buckets[-1] > self.max_seq_len:
            raise ValueError(f"buckets {self.prefill_buckets} / {self.kv_buckets} exceed "
                             f"max_seq_len={self.max_seq_len}")
        if self.max_prefill_batch < 1 or self.decode_steps < 1 or self.num_slots < 1:
            raise ValueError("num_slots, max_prefill_batch and decode_steps must be >= 1")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 16:
            raise ValueError(f"chunked_prefill_size must be >= 16 tokens, or -1 to disable chunking; "
                             f"got {self.chunked_prefill_size}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1 or None (unbounded), got {self.max_queued_requests}")
        if self.kv_cache not in ("slots", "paged"):
            raise ValueError(f"kv_cache must be 'paged' or 'slots', got {self.kv_cache!r} (EngineConfig.kv_cache, "
                             f"areal-jax serve --kv-cache, or the environment's {KV_CACHE_ENV})")
        from areal_jax.models.paged_kernels import ATTENTION_BACKENDS

        if self.layer_layout not in ("split", "stacked"):
            raise ValueError(f"layer_layout={self.layer_layout!r} (--layer-layout): choose 'split' or 'stacked'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} (--attention-backend): choose one of "
                             f"{list(ATTENTION_BACKENDS)}")
        if self.attention_backend == "fa" and self.kv_cache != "paged":
            raise ValueError("--attention-backend fa runs over the page pool, not kv_cache='slots' "
                             "(--kv-cache slots); use --kv-cache paged, or --attention-backend auto")
        if self.compile_threads < 0:
            raise ValueError(f"compile_threads must be >= 0 (0: compile each shape at its first call), got "
                             f"{self.compile_threads} (EngineConfig.compile_threads, --compile-threads)")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1 token, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens={self.max_total_tokens} holds no page of {self.page_size} tokens; "
                             "raise --max-total-tokens")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must lie strictly between 0 and 1, got {self.mem_fraction_static}")
        if self.lanes is not None and (self.lanes < 1 or self.num_slots % self.lanes):
            raise ValueError(f"lanes={self.lanes} must be >= 1 and divide num_slots={self.num_slots}")

    @property
    def prefill_chunk(self) -> int | None:
        """Tokens per chunk of a chunked prefill, or None when chunking is off or never needed."""
        c = self.chunked_prefill_size
        return None if c == -1 or c >= self.max_seq_len else c

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        return tuple(powers_of_two(1, self.max_prefill_batch)) + (self.max_prefill_batch,)

    def resolve_lanes(self, backend: str, has_mesh: bool) -> int:
        """The lane count to run with on ``backend`` (see ``lanes``)."""
        if self.lanes is not None:
            if self.lanes > 1 and has_mesh:
                raise ValueError(f"lanes={self.lanes} needs mesh=None: lanes are concurrent programs, "
                                 "and over a mesh their collectives could interleave; use lanes=1")
            return self.lanes
        auto = backend == "cpu" and not has_mesh and usable_cpus() >= 2
        return 2 if auto and self.num_slots >= 4 and self.num_slots % 2 == 0 else 1
