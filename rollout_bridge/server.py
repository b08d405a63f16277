"""The embedded JAX server: an aiohttp front that speaks SGLang's native API over an ``Engine``.

A rollout client cannot tell it from a real SGLang server for the endpoints in ``protocol`` and
the OpenAI-compatible ones in ``openai_api``. Errors in a request are HTTP 400 with
``{"error": {"message", "code"}}`` naming the field (a duplicate ``rid`` too); a full waiting
queue is a 503 with ``Retry-After``; a request the engine fails (its step raised) is a 500 with
the error; a weight load that fails answers ``success: false`` (HTTP 400, as SGLang does) and the
old weights keep serving. A client that goes away aborts its
request. On shutdown, requests in flight are answered with an abort and their tokens so far
before the connections close. ``weight_version`` is a free-form label, as in SGLang ("default" until a weight update
names one); the engine's integer version is internal bookkeeping. With an API key, every endpoint
but ``/health`` and ``/health_generate`` wants ``Authorization: Bearer KEY`` (compared in constant
time). A request body past its bound is a 413: ``max_request_bytes`` for the JSON endpoints,
``max_body_bytes`` for a weight bucket (``/update_weights_from_tensor``). ``/update_weights_from_disk``
loads only from directories under ``weight_roots`` (see ``weights_api``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal_jax.inference.types import (
    DuplicateRequestError,
    EngineDeadError,
    GenerateOutput,
    GenerateRequest,
    QueueFullError,
)
from areal_jax.inference.types import SamplingParams as EngineSamplingParams
from rollout_bridge import protocol as P

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/health_generate"})
WARMUP_PATHS = OPEN_PATHS | {"/get_model_info", "/model_info", "/get_server_info", "/server_info",
                             "/get_weight_version", "/weight_version", "/metrics"}
"""What answers while the engine compiles at start-up; everything else is a 503 until it is ready."""
SERVER_VERSION = "areal-jax-0.1"
DEFAULT_WEIGHT_VERSION = "default"
"""SGLang's label for the weights a server started with (its ``--weight-version`` default)."""
RETRY_AFTER_S = 1
BUCKET_PATHS = frozenset({"/update_weights_from_tensor"})
"""Endpoints whose body is a weight bucket, bounded by ``max_body_bytes`` rather than ``max_request_bytes``."""
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2
DEFAULT_MAX_BODY_BYTES = 4 * 1024**3
DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S = 300.0


@dataclass
class ServerState:
    engine: Any
    tokenizer: Any
    api_key: str | None
    model_path: str = ""
    tokenizer_path: str = ""
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    health_timeout_s: float = 30.0
    staged: Any = None
    """The weight transfer being received (``weights_api``)."""
    held: Any = None
    """A finished transfer sent with ``hold``: weights built, waiting for ``/commit_weights``."""
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    weight_version: str = DEFAULT_WEIGHT_VERSION
    """The label served now; any string."""
    labels: dict[int, str] = field(default_factory=dict)
    """Engine version -> the label it was served under, for the spans of answers in flight."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra ``internal_states`` of /get_server_info (tp_size, dp_size, ...)."""
    metrics_mark: tuple[float, int] = (0.0, 0)
    """(time, generated tokens) at the last /metrics scrape, for its tokens/s."""
    shutting_down: bool = False
    ready: bool = True
    """False while the engine compiles its steps at start-up: /health answers 503 until then."""
    warmup: dict[str, Any] = field(default_factory=dict)
    """How the start-up compilation went (``shapes``, ``seconds``, or ``error``)."""
    weight_roots: tuple[str, ...] = ()
    """Resolved directories (or URL prefixes) ``/update_weights_from_disk`` may load from."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bound on a JSON request body (413 past it)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Bound on one weight bucket's body (413 past it)."""
    weight_transfer_timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S
    """A staged weight transfer with no bucket for this long is dropped, freeing its tensors."""
    incremental_streaming_output: bool = False
    """A streamed /generate sends each event's new text, tokens and logprobs only (SGLang's
    ``--incremental-streaming-output``); without it every event repeats the answer so far, as
    stock SGLang does by default."""

    @property
    def paused(self) -> bool:
        """The engine is paused (by ``/pause_generation``, or for a commit's swap): the engine's
        own state, so that it cannot disagree with what the engine does."""
        return self.engine.paused is not None

    def label_of(self, version: int) -> str:
        return self.labels.get(version, self.weight_version)

    def relabel(self, label: str) -> None:
        self.weight_version = label
        self.labels[self.engine.version] = label
        while len(self.labels) > 1024:  # only versions still in flight matter
            del self.labels[next(iter(self.labels))]


STATE = web.AppKey("state", ServerState)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=P.encode(obj), status=status, content_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    resp = json_response({"error": {"message": message, "code": status}}, status)
    resp.headers.update(headers or {})
    return resp


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[STATE]
    if not st.ready and request.path not in WARMUP_PATHS:
        return _error(503, _not_ready(st), {"Retry-After": str(RETRY_AFTER_S)})
    if st.api_key and request.path not in OPEN_PATHS:
        # aiohttp keeps bytes that are not UTF-8 as surrogates: compare them as sent, never fail
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, f"Bearer {st.api_key}".encode()):
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
    try:
        return await handler(_bounded(st, request))
    except web.HTTPRequestEntityTooLarge as e:
        return _error(413, f"request body too large: {e.text}")
    except P.ProtocolError as e:
        return _error(400, str(e))
    except DuplicateRequestError as e:
        return _error(400, f"rid: {e}")
    except QueueFullError as e:
        return _error(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})
    except EngineFailed as e:
        return _error(e.status, str(e))
    except EngineDeadError as e:  # /health says 503 and the server exits: a supervisor restarts it
        return _error(500, str(e))
    except web.HTTPException:
        raise
    except ConnectionResetError:  # the client went away; its request was aborted
        log.debug("%s %s: client closed the connection", request.method, request.path)
        raise
    except Exception as e:  # a bug, not a bad request: say so, keep serving
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


def _bounded(st: ServerState, request: web.Request) -> web.Request:
    """``request`` with its endpoint's body bound: 413 at once from ``Content-Length``, else
    (a chunked body) when reading passes it, so no more than the bound is ever held."""
    if not request.body_exists:
        return request
    limit = st.max_body_bytes if request.path in BUCKET_PATHS else st.max_request_bytes
    n = request.content_length
    if n is not None and n > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=n)
    return request.clone(client_max_size=limit)


# --- /generate ---------------------------------------------------------------------------------

class EngineFailed(RuntimeError):
    """The engine failed a request (its step raised): HTTP ``status`` (5xx) with the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def checked(out: GenerateOutput) -> GenerateOutput:
    """``out``, unless the engine ended it with an error (an abort with a 5xx ``status_code``)."""
    code = int((out.finish_reason or {}).get("status_code") or 0)
    if code >= 500:
        raise EngineFailed(code, str(out.finish_reason.get("message")))
    return out


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
    P.validate_generate(req, vocab_size=engine.vocab_size, context_length=engine.max_seq_len)
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
    return GenerateRequest(input_ids=list(req.input_ids), sampling=esp, rid=req.rid or uuid.uuid4().hex,
                           return_logprob=req.return_logprob)


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
           prompt: dict[str, Any] | None = None) -> P.GenerateReqOutput:
    ids = list(out.output_ids)
    text = ""
    if st.tokenizer is not None and ids:
        text = st.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
    versions = list(out.output_versions or [])
    tok = _token_text(st, req)
    meta = P.MetaInfo(
        id=out.rid, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
        completion_tokens=len(ids), weight_version=st.label_of(out.weight_version),
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
        return _error(503, SHUTDOWN_MESSAGE)
    req = P.decode_generate(await request.read())
    if isinstance(req, list):
        return json_response(await _generate_batch(st, req, t0))
    ereq = engine_request(st, req)
    prompt = await input_logprobs(st, req)
    if not req.stream:
        # A client that disconnects cancels this handler, and the cancel aborts the request.
        out = checked(await st.engine.generate(ereq))
        return json_response(_reply(st, out, req, t0, prompt))
    render = (_Increments(st, req, t0, prompt) if st.incremental_streaming_output
              else lambda part: _reply(st, part, req, t0, prompt))
    return await stream_events(request, st.engine.stream(ereq), render)


async def _generate_batch(st: ServerState, reqs: list[P.GenerateReqInput], t0: float) -> list[P.GenerateReqOutput]:
    """SGLang's batch form: every input runs as its own engine request, all at once; the replies
    come back in input order. One that fails ends the others (they are aborted) and the call
    answers with its error."""
    ereqs = []
    for i, req in enumerate(reqs):
        try:
            ereqs.append(engine_request(st, req))
        except P.ProtocolError as e:
            raise P.ProtocolError(f"{e.field} (batch input {i})", e.message) from None
    prompts = [await input_logprobs(st, req) for req in reqs]

    async def one(ereq: GenerateRequest) -> GenerateOutput:
        return checked(await st.engine.generate(ereq))

    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(e)) for e in ereqs]
    except BaseExceptionGroup as eg:  # the first failure is the answer (cancelled ones are aborted)
        raise eg.exceptions[0] from None
    return [_reply(st, t.result(), req, t0, prompt) for t, req, prompt in zip(tasks, reqs, prompts, strict=True)]


class _Increments:
    """Renders cumulative engine outputs as the text, tokens and logprobs new since the previous
    event (``weight_versions`` spans index this event's ``output_ids``)."""

    def __init__(self, st: ServerState, req: P.GenerateReqInput, t0: float, prompt: dict[str, Any]):
        self.st, self.req, self.t0, self.prompt = st, req, t0, prompt
        self.text, self.n = "", 0

    def __call__(self, part: GenerateOutput) -> list[P.GenerateReqOutput]:
        full = _reply(self.st, part, self.req, self.t0, self.prompt)
        text = full.text if part.finished else full.text.rstrip("\ufffd")  # half a character: later
        start, self.n = self.n, len(full.output_ids)
        delta, self.text = text[len(self.text):], text
        if start == self.n and not delta and not part.finished:
            return []
        meta = full.meta_info
        self.prompt = {}  # the prompt's logprobs go with the first event only
        if meta.output_token_logprobs is not None:
            meta.output_token_logprobs = meta.output_token_logprobs[start:]
        if meta.output_top_logprobs is not None:
            meta.output_top_logprobs = meta.output_top_logprobs[start:]
        versions = [self.st.label_of(v) for v in (part.output_versions or [])[start:]]
        meta.weight_versions = P.version_spans(versions) if len(versions) == self.n - start else []
        return [P.GenerateReqOutput(text=delta, output_ids=full.output_ids[start:], meta_info=meta)]


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


# --- health and info ---------------------------------------------------------------------------

def _not_ready(st: ServerState) -> str:
    if "error" in st.warmup:
        return f"the start-up compilation failed: {st.warmup['error']}"
    return "warming up: compiling the engine's steps"


def _unhealthy(st: ServerState) -> web.Response | None:
    """A 503 when the server cannot generate: still compiling, or its engine is dead or stopped."""
    if not st.ready:
        return _error(503, _not_ready(st))
    if not st.engine.alive:
        error = st.engine.error
        return _error(503, "engine stopped" if error is None else f"engine dead: {error!r}")
    return None


async def health(request: web.Request) -> web.Response:
    """Healthy when the engine can generate: compiled, started, and no lane dead."""
    return _unhealthy(request.app[STATE]) or web.Response(text="")


HEALTH_POLL_S = 0.05
"""How often ``/health_generate`` looks at the engine's generated-token count while its probe waits."""


async def health_generate(request: web.Request) -> web.Response:
    """Healthy when the engine generates within the timeout: its probe's token, or any token
    (SGLang counts any progress, so a busy server whose probe waits behind the load, or is
    refused by a full queue, is not evicted); or when it is paused on purpose."""
    st = request.app[STATE]
    if (bad := _unhealthy(st)) is not None:
        return bad
    if st.paused:
        return web.Response(text="")
    e = st.engine
    probe = GenerateRequest(input_ids=[0], sampling=EngineSamplingParams(max_new_tokens=1, temperature=0.0),
                            rid=f"health-{uuid.uuid4().hex}", return_logprob=False)
    start, deadline = e.stats["generated_tokens"], time.monotonic() + st.health_timeout_s
    task = asyncio.ensure_future(e.generate(probe))  # cancelling it aborts the probe
    refused = False
    try:
        while True:
            if task.done() and not refused:
                try:
                    checked(task.result())
                    return web.Response(text="")
                except QueueFullError:  # busy: progress decides
                    refused = True
                except Exception as err:  # the engine failed the probe
                    return _error(503, f"engine did not generate: {type(err).__name__}: {err}")
            if e.stats["generated_tokens"] > start:
                return web.Response(text="")
            left = deadline - time.monotonic()
            if left <= 0:
                why = "its probe was refused (full queue)" if refused else "its probe waits"
                return _error(503, f"engine generated nothing in {st.health_timeout_s:g}s ({why})")
            if refused:
                await asyncio.sleep(min(HEALTH_POLL_S, left))
            else:
                await asyncio.wait({task}, timeout=min(HEALTH_POLL_S, left))
    finally:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning


async def get_model_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return json_response(P.ModelInfo(model_path=st.model_path, tokenizer_path=st.tokenizer_path,
                             served_model_name=st.served_model_name or st.model_path,
                             weight_version=st.weight_version))


async def get_weight_version(request: web.Request) -> web.Response:
    return json_response({"weight_version": request.app[STATE].weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    e = st.engine
    return json_response(P.ServerInfo(
        model_path=st.model_path, tokenizer_path=st.tokenizer_path,
        served_model_name=st.served_model_name or st.model_path, max_context_length=e.max_seq_len,
        version=SERVER_VERSION, host=st.host, port=st.port,
        incremental_streaming_output=st.incremental_streaming_output,
        internal_states=[{"num_running": e.num_running, "num_waiting": e.num_waiting,
                          "num_slots": e.lane_slots * e.num_lanes, "free_slots": e.num_free_slots,
                          "live_requests": e.num_live,
                          "weight_version": st.weight_version, "engine_version": e.version, "paused": st.paused,
                          "ready": st.ready, "warmup": st.warmup,
                          "lanes": e.num_lanes, "random_seed": e.seed,
                          "max_queued_requests": e.cfg.max_queued_requests,
                          "chunked_prefill_size": e.cfg.chunked_prefill_size, "placement": e.placement(),
                          **st.info}]))


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text format, SGLang's metric names where it has them."""
    st = request.app[STATE]
    e = st.engine
    now, tokens = time.monotonic(), e.stats["generated_tokens"]
    t_prev, tok_prev = st.metrics_mark
    throughput = (tokens - tok_prev) / (now - t_prev) if t_prev else 0.0
    st.metrics_mark = (now, tokens)
    name = (st.served_model_name or st.model_path).replace("\\", "\\\\").replace('"', '\\"')
    label = st.weight_version.replace("\\", "\\\\").replace('"', '\\"')
    rows = [
        ("sglang:num_running_reqs", "gauge", "The number of running requests.", e.num_running, ""),
        ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", e.num_waiting, ""),
        ("sglang:gen_throughput", "gauge", "The generation throughput (token/s) since the last scrape.",
         throughput, ""),
        ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", e.stats["prompt_tokens"], ""),
        ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", tokens, ""),
        ("areal_jax:shared_prompt_tokens_total", "counter", "Prompt tokens not prefilled: copied from a request "
         "admitted with the same tokens.", e.stats["shared_prompt_tokens"], ""),
        ("areal_jax:prefill_padded_tokens_total", "counter", "Token rows computed by prefill calls, padding "
         "included (each call pads its rows to one length).", e.stats["prefill_padded_tokens"], ""),
        ("areal_jax:prefill_seconds_total", "counter", "Seconds in compiled prefill calls (prompts, and the "
         "prefixes of requests resumed after a pause), summed over lanes.", e.stats["prefill_seconds"], ""),
        ("areal_jax:decode_seconds_total", "counter", "Seconds in compiled decode calls, summed over lanes.",
         e.stats["decode_seconds"], ""),
        ("areal_jax:paused_seconds_total", "counter", "Seconds paused (from each pause_generation to the "
         "continue_generation after it): weight updates that keep the server from generating.",
         e.stats["paused_seconds"], ""),
        ("sglang:num_requests_total", "counter", "Number of finished requests.", e.stats["finished_requests"], ""),
        ("areal_jax:weight_version", "gauge", "Weight updates applied (internal version); the label is "
         "weight_version.", e.version, f',weight_version="{label}"'),
    ]
    lines = []
    for metric, kind, help_, value, extra in rows:
        lines += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}",
                  f'{metric}{{model_name="{name}"{extra}}} {float(value)}']
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


# --- control -----------------------------------------------------------------------------------

async def flush_cache(request: web.Request) -> web.Response:
    ok = await request.app[STATE].engine.flush_cache()
    if not ok:
        return web.Response(text="Cache not flushed: requests are running.", status=400)
    return web.Response(text="Cache flushed.")


async def abort_request(request: web.Request) -> web.Response:
    req = P.decode(await request.read(), P.AbortReqInput)
    if not req.abort_all and not req.rid:  # as SGLang: nothing to abort, said in the log, not an error
        log.warning("/abort_request without a rid nor abort_all: nothing aborted")
        return json_response({"success": True, "num_aborted": 0})
    n = await request.app[STATE].engine.abort(req.rid or None, abort_all=req.abort_all)
    return json_response({"success": True, "num_aborted": n})


async def pause_generation(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = P.decode(await request.read(), P.PauseGenerationReqInput)
    await st.engine.pause(req.mode)
    return json_response({"success": True, "message": f"Generation paused ({req.mode})."})


async def continue_generation(request: web.Request) -> web.Response:
    st = request.app[STATE]
    await st.engine.resume()
    return json_response({"success": True, "message": "Generation continued."})


def build_app(engine: Any, tokenizer: Any = None, api_key: str | None = None, *, model_path: str = "",
              tokenizer_path: str | None = None, served_model_name: str = "",
              weight_version: str = DEFAULT_WEIGHT_VERSION, info: dict[str, Any] | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              weight_roots: Sequence[str | os.PathLike] | None = None,
              weight_transfer_timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S, manage_engine: bool = True,
              incremental_streaming_output: bool = False, warmup: bool = False) -> web.Application:
    """The aiohttp app over ``engine``; with ``manage_engine`` it starts and stops the engine.
    ``weight_roots``: where ``/update_weights_from_disk`` may load from (default: the parent
    directory of ``model_path``; none without a model path). ``max_request_bytes`` bounds a JSON
    body, ``max_body_bytes`` a weight bucket; ``weight_transfer_timeout_s`` drops an unfinished
    bucketed transfer that went quiet.
    ``incremental_streaming_output``: see ``ServerState``. With ``warmup``, the engine compiles
    every step shape (``Engine.warmup``) after the server starts listening and before it starts
    the engine; until then /health is a 503 and requests get a 503."""
    if warmup and not manage_engine:
        raise ValueError("warmup needs manage_engine: the engine compiles before it starts")
    from rollout_bridge import openai_api, weights_api

    if weight_roots is None:
        weight_roots = [default_weight_root(model_path)] if model_path else []
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=max(max_body_bytes, max_request_bytes))
    st = ServerState(engine=engine, tokenizer=tokenizer, api_key=api_key, model_path=model_path,
                     tokenizer_path=tokenizer_path or model_path, served_model_name=served_model_name,
                     info=dict(info or {}), incremental_streaming_output=incremental_streaming_output,
                     weight_roots=resolve_weight_roots(weight_roots), max_request_bytes=max_request_bytes,
                     max_body_bytes=max_body_bytes,
                     weight_transfer_timeout_s=weight_transfer_timeout_s)
    st.relabel(weight_version)
    app[STATE] = st
    r = app.router
    r.add_post("/generate", generate)
    for path, fn in (("/health", health), ("/health_generate", health_generate),
                     ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                     ("/get_server_info", get_server_info), ("/server_info", get_server_info),
                     ("/get_weight_version", get_weight_version), ("/weight_version", get_weight_version)):
        r.add_get(path, fn)
        r.add_post(path, fn)
    r.add_get("/metrics", metrics)
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    weights_api.add_routes(app)
    openai_api.add_routes(app)
    app.on_shutdown.append(_answer_in_flight)
    app.on_cleanup.append(weights_api.drop_staged)
    if manage_engine:
        tasks: list[asyncio.Task] = []
        stopping = threading.Event()

        async def _start(app: web.Application) -> None:
            if warmup:
                st.ready = False
                tasks.append(asyncio.create_task(_warm_then_start(st, stopping), name="engine-warmup"))
            else:
                await engine.start()

        async def _stop(app: web.Application) -> None:
            # The compile runs in a thread, which a cancel would not stop (and the process could
            # not exit before it ended): it stops after the shape in hand, and is waited for.
            stopping.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.stop()

        app.on_startup.append(_start)
        app.on_cleanup.append(_stop)
    return app


async def _warm_then_start(st: ServerState, stopping: threading.Event) -> None:
    t0 = time.perf_counter()
    try:
        shapes = await asyncio.to_thread(st.engine.warmup, stopping)
    except Exception as e:
        log.exception("start-up compilation failed")
        st.warmup = {"error": f"{type(e).__name__}: {e}"}
        return
    st.warmup = {"shapes": shapes, "seconds": round(time.perf_counter() - t0, 2)}
    if stopping.is_set():
        st.warmup["stopped"] = True
        log.info("stopped compiling after %d of %d step shapes: shutting down", shapes, len(st.engine.step_shapes()))
        return
    await st.engine.start()
    st.ready = True
    log.info("compiled %d step shapes in %.1f s: ready", shapes, st.warmup["seconds"])


def default_weight_root(model_path: str | os.PathLike) -> str:
    """The directory that holds the served model: a run's ``base``, ``warm_start`` and ``weights``
    directories are siblings, so a run's own weight pushes load by default."""
    path = os.fspath(model_path).rstrip("/")
    if "://" in path:
        return path.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(path))


def resolve_weight_roots(roots: Sequence[str | os.PathLike]) -> tuple[str, ...]:
    """``roots`` resolved (symlinks and ``..``), URLs kept as written without a trailing slash."""
    out = []
    for r in roots:
        r = os.fspath(r)
        out.append(r.rstrip("/") if "://" in r else os.path.realpath(r))
    return tuple(dict.fromkeys(out))


SHUTDOWN_MESSAGE = "server shutting down"


async def _answer_in_flight(app: web.Application) -> None:
    """On shutdown, before connections close: every request still waiting or running is aborted,
    so its handler answers with the tokens so far and a client can resume it elsewhere; requests
    that arrive on open connections from now on get a 503."""
    st = app[STATE]
    st.shutting_down = True
    if st.engine.num_running or st.engine.num_waiting:
        n = await st.engine.abort(abort_all=True, message=SHUTDOWN_MESSAGE)
        log.info("shutting down: %d request(s) answered with their partial output", n)


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                       shutdown_timeout: float = 10.0) -> tuple[web.AppRunner, int]:
    """Serve ``app`` in this event loop; returns the runner (``await runner.cleanup()`` to stop,
    giving running requests ``shutdown_timeout`` seconds) and the bound port (useful with port 0).
    A client that disconnects cancels its handler, which aborts its request in the engine."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp has no public getter
    st = app[STATE]
    st.host, st.port = host, bound
    return runner, bound
