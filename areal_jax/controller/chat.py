"""An ``openai``-SDK-shaped chat client that records what it generates, for agentic workflows.

Agent code written against ``openai.AsyncOpenAI`` (``await client.chat.completions.create(
messages=..., tools=...)``, reading ``.choices[0].message.content`` and ``.tool_calls``) runs
unchanged against ``RecordingChat``: each call renders the messages with the tokenizer's chat
template (tools included, when the template takes them), generates through the rollout client,
and keeps the completion's token ids, logprobs and per-token policy versions. ``export`` turns
the recorded completions into trajectories, with the reward the agent returned or the ones it
set per completion (``set_reward``).

Tool calls are parsed from the Hermes/Qwen convention, ``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, which is what Qwen-family chat templates teach the model to write.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

import numpy as np

from areal_jax.data.trajectory import Trajectory

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


@dataclass
class Function:
    name: str
    arguments: str
    """JSON text, as the openai SDK gives it."""


@dataclass
class ChatCompletionMessageToolCall:
    id: str
    function: Function
    type: str = "function"


@dataclass
class ChatCompletionMessage:
    content: str | None
    role: str = "assistant"
    tool_calls: list[ChatCompletionMessageToolCall] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as a dict to append to ``messages`` for the next call."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [asdict(c) for c in self.tool_calls]
        return out


@dataclass
class Choice:
    index: int
    message: ChatCompletionMessage
    finish_reason: str
    """``stop``, ``length`` or ``tool_calls``, as openai reports them."""


@dataclass
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass
class ChatCompletion:
    id: str
    choices: list[Choice]
    created: int
    model: str
    usage: CompletionUsage
    object: str = "chat.completion"


@dataclass
class _Record:
    completion: ChatCompletion
    prompt_ids: list[int]
    result: Any
    reward: float | None = None


@dataclass
class _Completions:
    owner: RecordingChat

    async def create(self, *, messages: list[Any], tools: list[dict[str, Any]] | None = None,
                     temperature: float | None = None, top_p: float | None = None,
                     max_tokens: int | None = None, max_completion_tokens: int | None = None,
                     model: str | None = None, **unsupported: Any) -> ChatCompletion:
        return await self.owner._create(messages, tools, temperature, top_p,
                                        max_completion_tokens or max_tokens, model, unsupported)


@dataclass
class RecordingChat:
    """``chat.completions.create(...)`` (and ``chat.chat.completions.create``, the SDK's path)."""

    client: Any
    """The workflow's ``EpisodeClient``."""
    records: list[_Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.completions = _Completions(self)

    @property
    def chat(self) -> RecordingChat:
        return self

    async def _create(self, messages: list[Any], tools: list[dict[str, Any]] | None, temperature: float | None,
                      top_p: float | None, max_tokens: int | None, model: str | None,
                      unsupported: dict[str, Any]) -> ChatCompletion:
        unsupported = {k: v for k, v in unsupported.items() if v is not None}
        if unsupported.pop("n", 1) != 1:
            raise ValueError("chat.completions.create: n > 1 is not supported; a workflow runs group_size agents")
        if unsupported:
            raise ValueError(f"chat.completions.create: unsupported arguments {sorted(unsupported)}")
        msgs = [m.to_dict() if isinstance(m, ChatCompletionMessage) else asdict(m) if is_dataclass(m) else dict(m)
                for m in messages]
        tok = self.client.tokenizer
        kwargs = {"tools": tools} if tools else {}
        prompt = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
        prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        overrides: dict[str, Any] = {}
        if temperature is not None:
            overrides["temperature"] = temperature
        if top_p is not None:
            overrides["top_p"] = top_p
        if max_tokens is not None:
            overrides["max_new_tokens"] = max_tokens
        result = await self.client.generate(prompt_ids, **overrides)
        text = self.client.decode(result.output_ids)
        calls = [ChatCompletionMessageToolCall(id=f"call_{uuid.uuid4().hex[:12]}", function=Function(
            name=str(c.get("name", "")), arguments=json.dumps(c.get("arguments", {}))))
            for c in _parse_tool_calls(text)]
        finish = "tool_calls" if calls else ("length" if result.finish_reason.get("type") == "length" else "stop")
        content = _TOOL_CALL.sub("", text).strip() if calls else text
        completion = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model or "areal-jax",
            choices=[Choice(0, ChatCompletionMessage(content=content, tool_calls=calls or None), finish)],
            usage=CompletionUsage(len(prompt_ids), len(result.output_ids), len(prompt_ids) + len(result.output_ids)))
        self.records.append(_Record(completion, prompt_ids, result))
        return completion

    def set_reward(self, completion_id: str, reward: float) -> None:
        """Give one recorded completion its own reward (overrides the one ``export`` is given)."""
        for r in self.records:
            if r.completion.id == completion_id:
                r.reward = float(reward)
                return
        raise KeyError(f"no recorded completion {completion_id!r}")

    def export(self, reward: float | None = None, turn_discount: float = 1.0) -> list[Trajectory]:
        """Every recorded completion with tokens as a trajectory of its own (per turn). A
        completion without a reward of its own (``set_reward``) gets ``reward`` times
        ``turn_discount`` per later completion of the run: the last gets ``reward``, the one
        before ``reward * turn_discount``, and so on (AReaL's reward discount)."""
        out = []
        n = len(self.records)
        for i, r in enumerate(self.records):
            value = r.reward
            if value is None and reward is not None:
                value = reward * turn_discount ** (n - 1 - i)
            if value is None:
                raise ValueError(f"completion {r.completion.id} has no reward: return one from the agent "
                                 "or call chat.set_reward(completion.id, reward)")
            if r.result.output_ids:
                out.append(self.client.trajectory(r.prompt_ids, r.result, value))
        return out

    def export_concat(self, reward: float | None = None) -> Trajectory | None:
        """The whole run as one trajectory (AReaL's ``export_interactions(style="concat")``): each
        call's prompt continues the run so far, so the turns concatenate; the tokens the model
        generated are trained (with their logprobs and versions), what the environment added
        between them (tool results, user turns, the template's turn markers) is not. The reward
        is ``reward``, or else the last completion's own (``set_reward``). None: no tokens."""
        records = [r for r in self.records if r.result.output_ids]
        if not records:
            return None
        value = reward if reward is not None else records[-1].reward
        if value is None:
            raise ValueError(f"the agent run has no reward: return one from the agent or call "
                             f"chat.set_reward({records[-1].completion.id!r}, reward) on its last completion")
        ids: list[int] = []
        mask: list[float] = []
        logprobs: list[float] = []
        versions: list[int] = []
        for k, r in enumerate(records):
            env = self._continuation(ids, r.prompt_ids, k)
            ids += env
            mask += [0.0] * len(env)
            logprobs += [0.0] * len(env)
            versions += [-1] * len(env)
            out = list(r.result.output_ids)
            ids += out
            mask += [1.0] * len(out)
            logprobs += list(r.result.output_logprobs)
            versions += list(r.result.output_versions)
        from areal_jax.controller.workflow import truncated

        return Trajectory(input_ids=np.asarray(ids), loss_mask=np.asarray(mask),
                          behavior_logprobs=np.asarray(logprobs), versions=np.asarray(versions), reward=value,
                          group_id=0, prompt_len=len(records[0].prompt_ids), truncated=truncated(records[-1].result))

    def _continuation(self, so_far: list[int], prompt: list[int], call: int) -> list[int]:
        """The tokens ``prompt`` adds after the run's tokens ``so_far``. The template usually
        renders the earlier turns exactly as generated (a token prefix); when it re-tokenises an
        answer differently, the text after the run's text is tokenised on its own."""
        if prompt[:len(so_far)] == so_far:
            return prompt[len(so_far):]
        tok = self.client.tokenizer
        before, now = tok.decode(so_far), tok.decode(prompt)
        if now.startswith(before):
            return list(tok.encode(now[len(before):], add_special_tokens=False))
        at = next(i for i, (a, b) in enumerate(zip(so_far, prompt, strict=False)) if a != b) \
            if any(a != b for a, b in zip(so_far, prompt, strict=False)) else min(len(so_far), len(prompt))
        raise ValueError(
            f"agent run, call {call + 1}: its messages do not continue the run so far (they differ at token {at}: "
            f"{tok.decode(prompt[max(0, at - 20):at + 20])!r} where the run has "
            f"{tok.decode(so_far[max(0, at - 20):at + 20])!r}), so the run cannot be one trajectory. Pass each "
            "reply's message back unchanged and only append to messages, or set "
            "rollout.workflow_options.trajectory=per_turn (each completion its own trajectory)")


def _parse_tool_calls(text: str) -> list[dict[str, Any]]:
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue  # a malformed call stays in the content, as text
        if isinstance(obj, dict):
            calls.append(obj)
    return calls
