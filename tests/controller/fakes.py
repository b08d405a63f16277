"""Stand-ins that let a workflow run without a server or reward workers: a rollout client that
answers from a script (recording what it was asked), and a reward pool that compares the answer
with the row's ``answer`` field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_jax.controller import EpisodeClient
from areal_jax.data.datasets import PromptRow
from areal_jax.models import encode_chat
from areal_jax.rewards.pool import RewardResult
from rollout_bridge.client import GenerateResult


@dataclass
class Answer:
    """One scripted reply: its text, and per token its logprob and policy version."""

    text: str
    logprobs: list[float]
    versions: list[int]
    finish: str = "stop"
    eos: bool = True
    """End with the tokenizer's end-of-turn token, as a server's answer stopped by it does."""


@dataclass
class ScriptedRollout:
    """``generate`` returns the scripted answers in order; ``calls`` keeps each request."""

    tokenizer: Any
    answers: list[Answer]
    calls: list[tuple[list[int], dict[str, Any]]] = field(default_factory=list)

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None) -> GenerateResult:
        a = self.answers[len(self.calls)]
        self.calls.append((list(input_ids), dict(sampling_params or {})))
        ids = self.answer_ids(a)
        assert len(ids) == len(a.logprobs) == len(a.versions), "a scripted answer needs one logprob and version a token"
        return GenerateResult(rid or f"r{len(self.calls)}", list(input_ids), ids, list(a.logprobs), list(a.versions),
                              {"type": a.finish}, text=a.text)

    def answer_ids(self, a: Answer) -> list[int]:
        ids = list(self.tokenizer.encode(a.text, add_special_tokens=False))
        return ids + [self.tokenizer.eos_token_id] if a.eos else ids


@dataclass
class ExactAnswerRewards:
    """Reward 1 when the completion is the row's ``answer``, else 0."""

    async def score(self, prompt: str, completion: str, reward_fields: dict[str, Any], *,
                    row_id: str | None = None) -> RewardResult:
        return RewardResult(1.0 if completion.strip() == reward_fields["answer"] else 0.0)


def row(tokenizer: Any, question: str, answer: str) -> PromptRow:
    messages = [{"role": "user", "content": question}]
    return PromptRow(id="q:0", prompt_ids=encode_chat(tokenizer, messages), messages=messages, prompt=question,
                     reward_fields={"answer": answer})


def episode_client(tokenizer: Any, rollout: ScriptedRollout, **options: Any) -> EpisodeClient:
    return EpisodeClient(rollout, tokenizer, ExactAnswerRewards(), {"temperature": 1.0, "max_new_tokens": 16},
                         group_size=1, options=options)
