"""The embedded server's OpenAI-compatible endpoints, shaped as SGLang serves them:
``/v1/completions``, ``/v1/chat/completions`` (both plain and streamed as server-sent events,
with per-token logprobs) and ``/v1/models``.

A request is mapped onto the native ``/generate`` path (same validation, same engine), so every
sampling parameter the native API refuses is refused here too, with the OpenAI name in the
message. Unknown fields are ignored, as OpenAI clients send many optional ones. Logprobs are the
sampled tokens' ``log_softmax(logits / T)``; the top-k alternatives (``top_logprobs``) are not
computed and come back empty.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from aiohttp import web

from areal_jax.inference.types import GenerateOutput
from rollout_bridge import protocol as P
from rollout_bridge.detokenize import IncrementalDetokenizer
from rollout_bridge.generate_api import engine_request, stream_events
from rollout_bridge.state import STATE, ServerState, checked

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw or b"{}")
    except msgspec.DecodeError as e:
        raise P.ProtocolError("body", f"not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise P.ProtocolError("body", "must be a JSON object")
    return body


def _refuse(body: dict[str, Any], field: str, neutral: Any, why: str) -> None:
    if body.get(field, neutral) not in (neutral, None):
        raise P.ProtocolError(field, why)


def _native(st: ServerState, body: dict[str, Any], input_ids: list[int], max_tokens: int | None) -> Any:
    """The native request for an OpenAI one (validated as /generate validates)."""
    if body.get("n", 1) != 1:
        raise P.ProtocolError("n", "only n=1 is served; send n requests")
    _refuse(body, "stop", None, "stop strings are not supported; use stop_token_ids")
    if isinstance(body.get("stop"), list) and body["stop"]:
        raise P.ProtocolError("stop", "stop strings are not supported; use stop_token_ids")
    if max_tokens is None:  # as SGLang: what the context leaves, one token short of it
        max_tokens = max(st.engine.max_seq_len - len(input_ids) - 1, 0)
    sp: dict[str, Any] = {"max_new_tokens": max_tokens}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("sampling_seed", "seed"), ("stop_token_ids", "stop_token_ids"),
                         ("ignore_eos", "ignore_eos"), ("skip_special_tokens", "skip_special_tokens"),
                         ("min_p", "min_p"), ("frequency_penalty", "frequency_penalty"),
                         ("presence_penalty", "presence_penalty"), ("repetition_penalty", "repetition_penalty")):
        if body.get(theirs) is not None:
            sp[ours] = body[theirs]
    rid = body.get("rid")
    raw = {"input_ids": input_ids, "sampling_params": sp, "return_logprob": True,
           **({"rid": str(rid)} if rid else {})}
    try:
        req = P.decode(P.encode(raw), P.GenerateReqInput)
    except P.ProtocolError as e:  # name the OpenAI field
        field = e.field.removeprefix("sampling_params.").replace("max_new_tokens", "max_tokens")
        raise P.ProtocolError(field.replace("sampling_seed", "seed"), str(e).split(": ", 1)[-1]) from None
    try:
        ereq = engine_request(st, req)
    except P.ProtocolError as e:
        field = e.field.removeprefix("sampling_params.").replace("max_new_tokens", "max_tokens")
        raise P.ProtocolError(field.replace("input_ids", "prompt"), str(e).split(": ", 1)[-1]) from None
    return req, ereq


def _prompt_ids(st: ServerState, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if st.tokenizer is None:
            raise P.ProtocolError("prompt", "this server has no tokenizer; send token ids")
        return list(st.tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise P.ProtocolError("prompt", "send one prompt: a string or a list of token ids (batches are not served)")


def _decode(st: ServerState, ids: list[int]) -> str:
    return st.tokenizer.decode(ids, skip_special_tokens=True) if st.tokenizer is not None and ids else ""


def _token_text(st: ServerState, token: int) -> str:
    return st.tokenizer.decode([token]) if st.tokenizer is not None else str(token)


def _usage(out: GenerateOutput) -> dict[str, int]:
    n = len(out.output_ids)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n}


def _finish(out: GenerateOutput) -> tuple[str | None, Any]:
    reason = out.finish_reason
    if reason is None:
        return None, None
    return _FINISH.get(reason["type"], reason["type"]), reason.get("matched")


class _Deltas:
    """The text of the engine's stream outputs (each holds the tokens new since the one before),
    decoded incrementally: a few tokens per output, whatever the answer's length."""

    def __init__(self, st: ServerState):
        self.detok = IncrementalDetokenizer(st.tokenizer) if st.tokenizer is not None else None

    def __call__(self, out: GenerateOutput) -> tuple[str, list[int], list[float], int]:
        """(new text, new tokens, their logprobs, characters before the new text)."""
        if self.detok is None:
            return "", out.output_ids, out.output_logprobs, 0
        offset = self.detok.text_len
        return self.detok.push(out.output_ids, final=out.finished), out.output_ids, out.output_logprobs, offset


def _completion_logprobs(st: ServerState, ids: list[int], lps: list[float], offset: int) -> dict[str, Any]:
    tokens = [_token_text(st, t) for t in ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": [None] * len(ids), "text_offset": offsets}


def _chat_logprobs(st: ServerState, ids: list[int], lps: list[float]) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, lps, strict=True):
        tok = _token_text(st, t)
        content.append({"token": tok, "bytes": list(tok.encode()), "logprob": lp, "top_logprobs": []})
    return {"content": content}


async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = _body(await request.read())
    _refuse(body, "echo", False, "echo is not supported")
    _refuse(body, "suffix", None, "suffix is not supported")
    _refuse(body, "best_of", 1, "best_of is not supported; send several requests")
    if "prompt" not in body:
        raise P.ProtocolError("prompt", "missing; send a string or a list of token ids")
    _, ereq = _native(st, body, _prompt_ids(st, body["prompt"]), body.get("max_tokens", 16))
    want_lp = body.get("logprobs") is not None
    rid, created, model = f"cmpl-{ereq.rid}", int(time.time()), st.served_model_name or st.model_path
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if not body.get("stream"):
        out = checked(await st.engine.generate(ereq))
        reason, matched = _finish(out)
        text = _decode(st, out.output_ids)
        choice = {"index": 0, "text": text, "finish_reason": reason, "matched_stop": matched,
                  "logprobs": _completion_logprobs(st, out.output_ids, out.output_logprobs, 0) if want_lp else None}
        return web.json_response({**head, "choices": [choice], "usage": _usage(out)}, dumps=_dumps)
    deltas = _Deltas(st)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

    def render(out: GenerateOutput) -> list[dict[str, Any]]:
        text, ids, lps, offset = deltas(out)
        reason, matched = _finish(out)
        if not text and not ids and reason is None:
            return []
        choice = {"index": 0, "text": text, "finish_reason": reason, "matched_stop": matched,
                  "logprobs": _completion_logprobs(st, ids, lps, offset) if want_lp else None}
        chunks = [{**head, "choices": [choice]}]
        if reason is not None and include_usage:
            chunks.append({**head, "choices": [], "usage": _usage(out)})
        return chunks

    return await stream_events(request, st.engine.stream(ereq), render)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    from areal_jax.models.tokenizer import encode_chat

    st = request.app[STATE]
    body = _body(await request.read())
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise P.ProtocolError("messages", "send a non-empty list of {role, content} messages")
    if body.get("tools"):
        raise P.ProtocolError("tools", "tool calls are not supported by this server")
    if st.tokenizer is None:
        raise P.ProtocolError("messages", "this server has no tokenizer, so no chat template")
    try:
        ids = encode_chat(st.tokenizer, messages)
    except Exception as e:
        raise P.ProtocolError("messages", f"the chat template failed: {e}") from None
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    _, ereq = _native(st, body, ids, max_tokens)
    want_lp = bool(body.get("logprobs"))
    rid, created, model = f"chatcmpl-{ereq.rid}", int(time.time()), st.served_model_name or st.model_path
    head = {"id": rid, "created": created, "model": model}
    if not body.get("stream"):
        out = checked(await st.engine.generate(ereq))
        reason, matched = _finish(out)
        choice = {"index": 0, "message": {"role": "assistant", "content": _decode(st, out.output_ids)},
                  "finish_reason": reason, "matched_stop": matched,
                  "logprobs": _chat_logprobs(st, out.output_ids, out.output_logprobs) if want_lp else None}
        return web.json_response({**head, "object": "chat.completion", "choices": [choice], "usage": _usage(out)},
                                 dumps=_dumps)
    head = {**head, "object": "chat.completion.chunk"}
    deltas = _Deltas(st)
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    started = False

    def render(out: GenerateOutput) -> list[dict[str, Any]]:
        nonlocal started
        chunks = []
        if not started:  # the first chunk names the role, as OpenAI and SGLang send it
            started = True
            chunks.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        text, ids, lps, _ = deltas(out)
        reason, matched = _finish(out)
        if text or ids or reason is not None:
            chunks.append({**head, "choices": [{
                "index": 0, "delta": {"content": text} if text or reason is None else {},
                "logprobs": _chat_logprobs(st, ids, lps) if want_lp and ids else None,
                "finish_reason": reason, "matched_stop": matched}]})
        if reason is not None and include_usage:
            chunks.append({**head, "choices": [], "usage": _usage(out)})
        return chunks

    return await stream_events(request, st.engine.stream(ereq), render)


async def models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = st.served_model_name or st.model_path
    return web.json_response({"object": "list", "data": [{
        "id": name, "object": "model", "created": int(time.time()), "owned_by": "areal-jax", "root": st.model_path,
        "max_model_len": st.engine.max_seq_len}]})


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)

