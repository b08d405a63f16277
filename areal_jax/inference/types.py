"""Request, sampling and output types of the generation engine (SGLang's names and defaults)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

FLOAT32_MAX = 3.4028234663852886e38
"""The largest temperature the engine's float32 sampling rows hold."""


@dataclass
class SamplingParams:
    """How to pick each new token; the defaults are SGLang's."""

    max_new_tokens: int = 128
    """Upper bound on generated tokens; 0 returns at once with no tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``."""
    top_k: int = -1
    """Keep only the ``top_k`` most likely tokens; -1 keeps the whole vocabulary."""
    stop_token_ids: list[int] | None = None
    """Token ids that end the request (the matched id is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence token(s)."""
    seed: int | None = None
    """Seed of this request's sampling stream; the same seed and prompt give the same output."""
    top_logprobs_num: int = 0
    """Also report the logprobs of this many likeliest tokens at each output token (SGLang's
    ``top_logprobs_num``)."""

    def validate(self, vocab_size: int) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not 0 <= self.temperature <= FLOAT32_MAX:  # also rejects NaN and what float32 cannot hold
            raise ValueError(f"temperature must be a number >= 0 and <= {FLOAT32_MAX:.3g}, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        bad = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {self.top_logprobs_num}")


@dataclass
class GenerateRequest:
    """One prompt (token ids) to continue."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class GenerateOutput:
    """A request's output so far; final when ``finish_reason`` is set."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    """``log_softmax(logits / T)`` over the full vocabulary at each output token (T=1 for greedy)."""
    output_versions: list[int]
    """Policy (weight) version that produced each output token."""
    finish_reason: dict | None
    """``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}``,
    ``{"type": "abort", "message": str}``; None on a partial (streamed) output."""
    weight_version: int
    """Engine version when this output was made."""
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    """With ``top_logprobs_num``: the likeliest (logprob, token id) at each output token."""
    cached_tokens: int = 0
    """Prompt tokens not prefilled at the request's first admission: their keys and values were
    read from another request's (the prefix cache's, or a running request with the same prefix;
    SGLang's ``meta_info.cached_tokens``)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_queued_requests`` already; retry later (HTTP 503 at the server)."""


class DuplicateRequestError(ValueError):
    """A request with this rid is already waiting or running (SGLang refuses it with a 400)."""


class EngineDeadError(RuntimeError):
    """A lane of the engine failed for good (say, its KV cache could not be re-allocated after a
    failed step): it takes no more requests, and a server over it reports unhealthy and exits so
    that a supervisor restarts it."""
