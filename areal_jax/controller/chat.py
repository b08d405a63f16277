"""An ``openai``-SDK chat client that records what it generates, for agentic workflows.

Agent code written against ``openai.AsyncOpenAI`` (``await client.chat.completions.create(
messages=..., tools=...)``, reading ``.choices[0].message.content`` and ``.tool_calls``) runs
unchanged against ``RecordingChat``, which answers with the SDK's own response types
(``openai.types.chat.ChatCompletion``: ``model_dump``, ``to_dict`` and the rest): each call
renders the messages with the tokenizer's chat template (tools included, when the template
takes them), generates through the rollout client, and keeps the completion's token ids,
logprobs and per-token policy versions. ``export_concat`` makes a run one trajectory,
``export`` one per completion.

What agents commonly pass is supported: ``stop`` (a string or list; single-token stops go to
the server as stop tokens, longer ones cut the answer where the text first contains them),
``tool_choice`` (``auto``, ``none``), ``response_format`` (accepted, not enforced: the reward
teaches the format), ``n`` (answers asked together), ``temperature``, ``top_p``,
``max_tokens``/``max_completion_tokens``, ``seed``. ``stream``, and ``tool_choice`` values that
force a call, need constrained decoding and are refused with the reason.

Tool calls are parsed in the format the model's chat template teaches (``tool_parser``):
``hermes`` for Qwen2.5/Qwen3 (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) and
``llama3_json`` for Llama 3.1+ (the answer is ``{"name": ..., "parameters": ...}``, optionally
after ``<|python_tag|>``, several separated by ``;``); ``auto`` picks by the template.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageToolCall
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_tool_call import Function

from areal_jax.data.trajectory import Trajectory

_HERMES = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOL_PARSERS = ("auto", "hermes", "llama3_json")


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes): the calls, and the
    text left around them. A block that is not valid JSON stays in the content, as text."""
    calls, kept = [], []
    last = 0
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append({"name": obj["name"], "arguments": obj.get("arguments", {})})
            kept.append(text[last:m.start()])
            last = m.end()
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.1+'s JSON calls: the whole answer is ``{"name": ..., "parameters": {...}}`` (or
    several, separated by ``;``), optionally after ``<|python_tag|>``. Anything else is content."""
    body = text.strip()
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
            return text, []
        calls.append({"name": obj["name"], "arguments": args})
        at = end
        while at < len(body) and body[at] in " \t\n;":
            at += 1
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def detect_tool_parser(chat_template: Any) -> str:
    """The tool-call format a chat template teaches: Llama 3's ``"parameters"`` JSON, else Hermes."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or ("<|eot_id|>" in text and "parameters" in text):
        return "llama3_json"
    return "hermes"


@dataclass
class _Record:
    completion: ChatCompletion
    prompt_ids: list[int]
    result: Any
    reward: float | None = None
    call: int = 0
    """Which ``create`` call made it (the answers of one call with ``n > 1`` share it)."""


@dataclass
class _Completions:
    owner: RecordingChat

    async def create(self, *, messages: list[Any], tools: list[Any] | None = None, tool_choice: Any = None,
                     temperature: float | None = None, top_p: float | None = None, max_tokens: int | None = None,
                     max_completion_tokens: int | None = None, stop: str | list[str] | None = None,
                     n: int | None = None, response_format: Any = None, seed: int | None = None,
                     stream: bool | None = None, model: str | None = None, **unsupported: Any) -> ChatCompletion:
        return await self.owner._create(messages, tools=tools, tool_choice=tool_choice, temperature=temperature,
                                        top_p=top_p, max_tokens=max_completion_tokens or max_tokens, stop=stop,
                                        n=n, response_format=response_format, seed=seed, stream=stream,
                                        model=model, unsupported=unsupported)


# Arguments the SDK takes that change nothing here (bookkeeping, or server-side features of a
# hosted API), accepted so agent code passes them as it does to OpenAI.
_IGNORED = {"user", "metadata", "store", "extra_headers", "extra_query", "extra_body", "timeout", "parallel_tool_calls",
            "service_tier", "stream_options", "logprobs", "top_logprobs", "modalities", "prediction"}


def _plain_message(m: Any) -> dict[str, Any]:
    """A message as the chat template wants it: SDK objects dumped, and tool-call arguments as a
    mapping (templates render ``arguments`` with ``tojson``; a JSON string would be quoted twice)."""
    if hasattr(m, "model_dump"):
        m = m.model_dump(exclude_none=True)
    m = dict(m)
    if m.get("content") is None:  # a tool-call-only turn: templates test or print the content
        m["content"] = ""
    calls = m.get("tool_calls")
    if calls:
        plain = []
        for c in calls:
            c = c.model_dump(exclude_none=True) if hasattr(c, "model_dump") else dict(c)
            fn = dict(c.get("function") or {})
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
            plain.append({**c, "function": fn})
        m["tool_calls"] = plain
    return m


@dataclass
class RecordingChat:
    """``chat.completions.create(...)`` (and ``chat.chat.completions.create``, the SDK's path)."""

    client: Any
    """The workflow's ``EpisodeClient``."""
    tool_parser: str = "auto"
    """``auto`` (by the chat template), ``hermes`` or ``llama3_json``."""
    records: list[_Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.completions = _Completions(self)
        if self.tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_parser={self.tool_parser!r}: choose one of {list(TOOL_PARSERS)}")
        if self.tool_parser == "auto":
            self.tool_parser = detect_tool_parser(getattr(self.client.tokenizer, "chat_template", None))
        self._calls = 0
        self._session = f"chat-{uuid.uuid4().hex}"  # its turns go to one server, which caches the ones before

    @property
    def chat(self) -> RecordingChat:
        return self

    async def _create(self, messages: list[Any], *, tools: list[Any] | None, tool_choice: Any,
                      temperature: float | None, top_p: float | None, max_tokens: int | None,
                      stop: str | list[str] | None, n: int | None, response_format: Any, seed: int | None,
                      stream: bool | None, model: str | None, unsupported: dict[str, Any]) -> ChatCompletion:
        unsupported = {k: v for k, v in unsupported.items() if v is not None and k not in _IGNORED}
        if unsupported:
            raise ValueError(f"chat.completions.create: unsupported arguments {sorted(unsupported)}")
        if stream:
            raise ValueError("chat.completions.create: stream=True is not supported; a training rollout needs the "
                             "whole answer (its tokens and logprobs) before the agent goes on")
        choice_mode = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
        if choice_mode not in (None, "auto", "none"):
            raise ValueError(f"chat.completions.create: tool_choice={tool_choice!r} would force a tool call, which "
                             "needs constrained decoding; pass 'auto' (the model decides) or 'none'")
        if response_format is not None:
            kind = response_format.get("type") if isinstance(response_format, dict) else None
            if kind not in ("text", "json_object", "json_schema"):
                raise ValueError(f"chat.completions.create: response_format={response_format!r}: expected a type "
                                 "of text, json_object or json_schema")
        use_tools = bool(tools) and choice_mode != "none"
        msgs = [_plain_message(m) for m in messages]
        tok = self.client.tokenizer
        kwargs = {"tools": [t.model_dump() if hasattr(t, "model_dump") else t for t in tools]} if use_tools else {}
        prompt = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, **kwargs)
        prompt_ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        overrides: dict[str, Any] = {}
        if temperature is not None:
            overrides["temperature"] = temperature
        if top_p is not None:
            overrides["top_p"] = top_p
        if max_tokens is not None:
            overrides["max_new_tokens"] = max_tokens
        if seed is not None:
            overrides["sampling_seed"] = seed
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        one_token = [ids[0] for ids in (tok.encode(s, add_special_tokens=False) for s in stops) if len(ids) == 1]
        if one_token:  # the server stops at them itself
            overrides["stop_token_ids"] = [*self.client.sampling.get("stop_token_ids", []), *one_token]
        n = 1 if n is None else int(n)
        if n < 1:
            raise ValueError(f"chat.completions.create: n must be >= 1, got {n}")
        results = ([await self.client.generate(prompt_ids, session=self._session, **overrides)] if n == 1 else
                   await self.client.generate_group(prompt_ids, n, session=self._session, **overrides))
        call, self._calls = self._calls, self._calls + 1
        choices, records = [], []
        for i, result in enumerate(results):
            result = _cut_at_stop(result, stops, tok) if stops else result
            text = self.client.decode(result.output_ids)
            text = _text_before_stop(text, stops)
            content, calls = (PARSERS[self.tool_parser](text) if use_tools else (text, []))
            tool_calls = [ChatCompletionMessageToolCall(
                id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                function=Function(name=c["name"], arguments=c["arguments"] if isinstance(c["arguments"], str)
                                  else json.dumps(c["arguments"], ensure_ascii=False))) for c in calls]
            finish = ("tool_calls" if tool_calls else
                      "length" if (result.finish_reason or {}).get("type") == "length" else "stop")
            choices.append(Choice(index=i, finish_reason=finish, message=ChatCompletionMessage(
                role="assistant", content=content, tool_calls=tool_calls or None)))
            records.append((result, len(result.output_ids)))
        completion = ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}", object="chat.completion", created=int(time.time()),
            model=model or "areal-jax", choices=choices,
            usage=CompletionUsage(prompt_tokens=len(prompt_ids), completion_tokens=sum(k for _, k in records),
                                  total_tokens=len(prompt_ids) + sum(k for _, k in records)))
        for result, _ in records:
            self.records.append(_Record(completion, prompt_ids, result, call=call))
        return completion

    def set_reward(self, completion_id: str, reward: float) -> None:
        """Give one recorded completion its own reward (overrides the one ``export`` is given)."""
        found = [r for r in self.records if r.completion.id == completion_id]
        if not found:
            raise KeyError(f"no recorded completion {completion_id!r}")
        for r in found:
            r.reward = float(reward)

    def export(self, reward: float | None = None, turn_discount: float = 1.0) -> list[Trajectory]:
        """Every recorded completion with tokens as a trajectory of its own (per turn). A
        completion without a reward of its own (``set_reward``) gets ``reward`` times
        ``turn_discount`` per later completion of the run: the last gets ``reward``, the one
        before ``reward * turn_discount``, and so on (AReaL's reward discount)."""
        out = []
        n = len(self.records)
        for i, r in enumerate(self.records):
            value, factor = r.reward, 1.0
            if value is None and reward is not None:
                factor = turn_discount ** (n - 1 - i)
                value = reward * factor
            if value is None:
                raise ValueError(f"completion {r.completion.id} has no reward: return one from the agent "
                                 "or call chat.set_reward(completion.id, reward)")
            if r.result.output_ids:
                out.append(self.client.trajectory(r.prompt_ids, r.result, value))
                out[-1].discount = factor
        return out

    def export_concat(self, reward: float | None = None) -> Trajectory | None:
        """The whole run as one trajectory (AReaL's ``export_interactions(style="concat")``): each
        call's prompt continues the run so far, so the turns concatenate; the tokens the model
        generated are trained (with their logprobs and versions), what the environment added
        between them (tool results, user turns, the template's turn markers) is not. The reward
        is ``reward``, or else the last completion's own (``set_reward``). None: no tokens.
        Of the answers of a call with ``n > 1``, the run goes on with the one the next call's
        messages continue (the last call's first)."""
        records = self._chain([r for r in self.records if r.result.output_ids])
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

    def _chain(self, records: list[_Record]) -> list[_Record]:
        """One record per call: with several answers to a call, the one the next call continues."""
        by_call: dict[int, list[_Record]] = {}
        for r in records:
            by_call.setdefault(r.call, []).append(r)
        calls = [by_call[c] for c in sorted(by_call)]
        out = []
        for k, options in enumerate(calls):
            pick = options[0]
            if len(options) > 1 and k + 1 < len(calls):
                nxt = calls[k + 1][0].prompt_ids
                tok = self.client.tokenizer
                for r in options:
                    seq = r.prompt_ids + list(r.result.output_ids)
                    if nxt[:len(seq)] == seq or tok.decode(nxt).startswith(tok.decode(seq)):
                        pick = r
                        break
            out.append(pick)
        return out

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


def _text_before_stop(text: str, stops: list[str]) -> str:
    """The text up to the first stop string, which OpenAI leaves out of the content."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text if cut < 0 else text[:cut]


def _cut_at_stop(result: Any, stops: list[str], tok: Any) -> Any:
    """``result`` ending at the token that completes the first stop string (the model wrote it
    and stopped there, as a server with stop strings would have ended it); unchanged if none."""
    import dataclasses

    text = tok.decode(result.output_ids, skip_special_tokens=True)
    if not any(s and s in text for s in stops):
        return result
    def holds(k: int) -> bool:
        return any(s and s in tok.decode(result.output_ids[:k], skip_special_tokens=True) for s in stops)

    lo, k = 1, len(result.output_ids)  # the shortest prefix that holds a stop (holding one is monotone)
    while lo < k:
        mid = (lo + k) // 2
        lo, k = (lo, mid) if holds(mid) else (mid + 1, k)
    return dataclasses.replace(result, output_ids=result.output_ids[:k], output_logprobs=result.output_logprobs[:k],
                               output_versions=result.output_versions[:k],
                               finish_reason={"type": "stop", "matched": "stop string"})
