"""The embedded server's ``/generate``: SGLang's native request (single or batch, streamed or
not) as engine requests, and their outputs as SGLang's replies (``meta_info`` with per-token
version spans, logprobs, prompt logprobs). ``openai_api`` builds on it."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from areal_jax.inference.types import GenerateOutput, GenerateRequest
from areal_jax.inference.types import SamplingParams as EngineSamplingParams
from rollout_bridge import protocol as P
from rollout_bridge import validation as V
from rollout_bridge.detokenize import IncrementalDetokenizer
from rollout_bridge.state import SHUTDOWN_MESSAGE, STATE, ServerState, checked, error_response, json_response

log = logging.getLogger("rollout_bridge.server")


def engine_request(st: ServerState, req: P.GenerateReqInput) -> GenerateRequest:
    engine = st.engine
    if req.input_ids is None:
        if req.text is None:
            raise P.ProtocolError("input_ids", "send input_ids (token ids) or text")
        if st.tokenizer is None:
            raise P.ProtocolError("text", "this server has no tokenizer; send input_ids")
        req.input_ids = list(st.tokenizer.encode(req.text, add_special_tokens=False))
    elif req.text is not None:
        raise P.ProtocolError("text", "send either text or input_ids, not both")
    V.validate_generate(req, vocab_size=engine.vocab_size, context_length=engine.max_seq_len)
    sp = req.sampling_params
    esp = EngineSamplingParams(
        max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
        top_k=-1 if sp.top_k >= P.CONTEXT_UNLIMITED_TOP_K else sp.top_k,
        stop_token_ids=list(sp.stop_token_ids) if sp.stop_token_ids else None,
        ignore_eos=sp.ignore_eos, seed=sp.sampling_seed, top_logprobs_num=req.top_logprobs_num or 0,
    )
    if esp.top_logprobs_num > engine.cfg.max_top_logprobs:
        raise P.ProtocolError("top_logprobs_num", f"at most {engine.cfg.max_top_logprobs} on this server, got "
                              f"{esp.top_logprobs_num}")
    try:
        esp.validate(engine.vocab_size)
    except ValueError as e:
        raise P.ProtocolError("sampling_params", str(e)) from None
    return GenerateRequest(input_ids=list(req.input_ids), sampling=esp, rid=req.rid or uuid.uuid4().hex)


def _token_text(st: ServerState, req: P.GenerateReqInput) -> Any:
    if req.return_text_in_logprobs and st.tokenizer is not None:
        return lambda t: st.tokenizer.decode([t])
    return lambda t: None


async def input_logprobs(st: ServerState, req: P.GenerateReqInput) -> dict[str, Any]:
    """``input_token_logprobs`` (and ``input_top_logprobs``) from ``logprob_start_len`` on, by
    one full forward over the prompt; {} when not asked for."""
    start = req.logprob_start_len
    if not req.return_logprob or start is None or start == -1:
        return {}
    ids, n = req.input_ids, req.top_logprobs_num or 0
    chosen, values, top = await asyncio.to_thread(st.engine.prompt_logprobs, ids, req.sampling_params.temperature)
    text = _token_text(st, req)
    out: dict[str, Any] = {"input_token_logprobs": [
        (None if p == 0 else float(chosen[p - 1]), int(ids[p]), text(ids[p])) for p in range(start, len(ids))]}
    if n:
        out["input_top_logprobs"] = [
            None if p == 0 else [(float(v), int(t), text(int(t))) for v, t in zip(values[p - 1][:n], top[p - 1][:n],
                                                                                 strict=True)]
            for p in range(start, len(ids))]
    return out


def _reply(st: ServerState, out: GenerateOutput, req: P.GenerateReqInput, t0: float,
           prompt: dict[str, Any] | None = None, text: str | None = None) -> P.GenerateReqOutput:
    """SGLang's reply for ``out``; ``text`` if given (a stream's, decoded incrementally), else
    ``out``'s tokens decoded."""
    ids = list(out.output_ids)
    if text is None:
        text = ""
        if st.tokenizer is not None and ids:
            text = st.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
    versions = list(out.output_versions or [])
    tok = _token_text(st, req)
    meta = P.MetaInfo(
        id=out.rid, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
        completion_tokens=len(ids), cached_tokens=out.cached_tokens, weight_version=st.label_of(out.weight_version),
        weight_versions=P.version_spans([st.label_of(v) for v in versions]) if len(versions) == len(ids) else [],
        output_token_logprobs=(
            [(float(lp), int(t), tok(t)) for lp, t in zip(out.output_logprobs, ids, strict=False)]
            if req.return_logprob else None),
        output_top_logprobs=(
            [[(lp, t, tok(t)) for lp, t in row] for row in out.output_top_logprobs]
            if req.return_logprob and out.output_top_logprobs is not None else None),
        e2e_latency=time.perf_counter() - t0, **(prompt or {}),
    )
    return P.GenerateReqOutput(text=text, output_ids=ids, meta_info=meta,
                               prompt_token_ids=list(req.input_ids) if req.return_prompt_token_ids else None)


async def generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = time.perf_counter()
    if st.shutting_down:
        return error_response(503, SHUTDOWN_MESSAGE)
    req = V.decode_generate(await request.read())
    if isinstance(req, list):
        if req[0].stream:
            return await _stream_batch(request, st, req, t0)
        return json_response(await _generate_batch(st, req, t0))
    ereq = engine_request(st, req)
    prompt = await input_logprobs(st, req)
    if not req.stream:
        # A client that disconnects cancels this handler, and the cancel aborts the request.
        out = checked(await st.engine.generate(ereq))
        return json_response(_reply(st, out, req, t0, prompt))
    render = _StreamRender(st, req, t0, prompt)
    return await stream_events(request, st.engine.stream(ereq), render)


def _batch_requests(st: ServerState, reqs: list[P.GenerateReqInput]) -> list[GenerateRequest]:
    ereqs = []
    for i, req in enumerate(reqs):
        try:
            ereqs.append(engine_request(st, req))
        except P.ProtocolError as e:
            raise P.ProtocolError(f"{e.field} (batch input {i})", e.message) from None
    return ereqs


async def _stream_batch(request: web.Request, st: ServerState, reqs: list[P.GenerateReqInput],
                        t0: float) -> web.StreamResponse:
    """A batch with ``stream``: every input runs as its own engine request, and their events go
    out as they come, interleaved, each with its input's ``index`` (SGLang's form)."""
    ereqs = _batch_requests(st, reqs)
    renders = [_StreamRender(st, req, t0, await input_logprobs(st, req)) for req in reqs]

    def render(item: tuple[int, GenerateOutput]) -> list[P.GenerateReqOutput]:
        i, part = item
        events = renders[i](part)
        for e in events:
            e.index = i
        return events

    return await stream_events(request, _interleaved([st.engine.stream(e) for e in ereqs]), render)


async def _interleaved(streams: list[Any]) -> Any:
    """(index, output) from every stream as each has one; closing it closes (aborts) them all."""
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    part = task.result()
                except StopAsyncIteration:
                    continue
                yield i, part
                pending[asyncio.ensure_future(anext(streams[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for s in streams:
            await s.aclose()


async def _generate_batch(st: ServerState, reqs: list[P.GenerateReqInput], t0: float) -> list[P.GenerateReqOutput]:
    """SGLang's batch form: every input runs as its own engine request, all at once; the replies
    come back in input order. One that fails ends the others (they are aborted) and the call
    answers with its error."""
    ereqs = _batch_requests(st, reqs)
    prompts = [await input_logprobs(st, req) for req in reqs]

    async def one(ereq: GenerateRequest) -> GenerateOutput:
        return checked(await st.engine.generate(ereq))

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(e)) for e in ereqs]
    except BaseExceptionGroup as eg:  # the first failure is the answer (cancelled ones are aborted)
        raise eg.exceptions[0] from None
    return [_reply(st, t.result(), req, t0, prompt) for t, req, prompt in zip(tasks, reqs, prompts, strict=True)]


class _StreamRender:
    """Renders the engine's stream (the tokens new at each output) as SGLang's events: with
    ``incremental_streaming_output`` each event carries the text, tokens and logprobs new since
    the previous one (``weight_versions`` spans index this event's ``output_ids``); without it,
    every event repeats the answer so far, as stock SGLang does. The text is decoded
    incrementally (``IncrementalDetokenizer``): a few tokens per event, whatever the answer's
    length; half of a multi-byte character waits for the rest."""

    def __init__(self, st: ServerState, req: P.GenerateReqInput, t0: float, prompt: dict[str, Any]):
        self.st, self.req, self.t0, self.prompt = st, req, t0, prompt
        self.detok = (IncrementalDetokenizer(st.tokenizer, skip_special_tokens=req.sampling_params.skip_special_tokens)
                      if st.tokenizer is not None else None)
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.tops: list[Any] | None = [] if req.top_logprobs_num else None

    def __call__(self, part: GenerateOutput) -> list[P.GenerateReqOutput]:
        delta = self.detok.push(part.output_ids, final=part.finished) if self.detok is not None else ""
        if self.st.incremental_streaming_output:
            if not part.output_ids and not delta and not part.finished:
                return []
            reply = _reply(self.st, part, self.req, self.t0, self.prompt, text=delta)
            self.prompt = {}  # the prompt's logprobs go with the first event only
            return [reply]
        self.text += delta
        self.ids += part.output_ids
        self.logprobs += part.output_logprobs
        self.versions += part.output_versions
        if self.tops is not None:
            self.tops += part.output_top_logprobs or []
        so_far = GenerateOutput(part.rid, part.prompt_tokens, self.ids, self.logprobs, self.versions,
                                part.finish_reason, part.weight_version, self.tops)
        return [_reply(self.st, so_far, self.req, self.t0, self.prompt, text=self.text)]


async def stream_events(request: web.Request, parts: Any, render: Any) -> web.StreamResponse:
    """Server-sent events: ``data: <render(part)>`` per engine output, then ``data: [DONE]``. A
    client that closes the stream ends it quietly (the engine aborts the request)."""
    first = await _first(parts)  # admission errors (400, 503) still get a status line
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        if first is not None:
            for chunk in _as_list(render(first)):
                await resp.write(b"data: " + P.encode(chunk) + b"\n\n")
            async for part in parts:
                for chunk in _as_list(render(part)):
                    await resp.write(b"data: " + P.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        log.debug("%s: client closed the stream", request.path)
        return resp
    except Exception as e:  # the status line is gone; report in-band as SGLang does
        log.exception("stream on %s failed", request.path)
        await resp.write(b"data: " + P.encode({"error": {"message": f"{type(e).__name__}: {e}"}}) + b"\n\n")
    finally:
        await parts.aclose()  # an unfinished request is aborted here
    await resp.write_eof()
    return resp


async def _first(parts: Any) -> Any:
    try:
        return await anext(parts)
    except StopAsyncIteration:
        return None


def _as_list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [x]

