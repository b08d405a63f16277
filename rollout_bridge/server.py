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

This module is the app: its middleware, the health, info and control routes, start-up and
shutdown. ``/generate`` is ``generate_api``'s, the weight endpoints ``weights_api``'s, ``/v1/...``
``openai_api``'s; the state they share is ``state``'s, which imports none of them.
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
from typing import Any

import msgspec
from aiohttp import web

from areal_jax.inference.types import (
    DuplicateRequestError,
    EngineDeadError,
    GenerateRequest,
    QueueFullError,
)
from areal_jax.inference.types import SamplingParams as EngineSamplingParams
from rollout_bridge import generate_api, metrics, openai_api, weights_api
from rollout_bridge import protocol as P
from rollout_bridge.state import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
    DEFAULT_WEIGHT_VERSION,
    GENERATION_PATHS,
    SHUTDOWN_MESSAGE,
    STATE,
    WEIGHT_UPDATE_MODES,
    EngineFailed,
    ServerState,
    checked,
    error_response,
    json_response,
)

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/health_generate"})
WARMUP_PATHS = OPEN_PATHS | {"/get_model_info", "/model_info", "/get_server_info", "/server_info",
                             "/get_weight_version", "/weight_version", "/metrics"}
"""What answers while the engine compiles at start-up; everything else is a 503 until it is ready."""
SERVER_VERSION = "areal-jax-0.1"
RETRY_AFTER_S = 1
BUCKET_PATHS = frozenset({"/update_weights_from_tensor"})
"""Endpoints whose body is a weight bucket, bounded by ``max_body_bytes`` rather than ``max_request_bytes``."""


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[STATE]
    if not st.ready and request.path not in WARMUP_PATHS:
        return error_response(503, _not_ready(st), {"Retry-After": str(RETRY_AFTER_S)})
    if st.api_key and request.path not in OPEN_PATHS:
        # aiohttp keeps bytes that are not UTF-8 as surrogates: compare them as sent, never fail
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, f"Bearer {st.api_key}".encode()):
            return error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
    try:
        if request.path in GENERATION_PATHS:
            async with st.generation():  # a draining weight update holds new requests
                return await handler(_bounded(st, request))
        return await handler(_bounded(st, request))
    except web.HTTPRequestEntityTooLarge as e:
        return error_response(413, f"request body too large: {e.text}")
    except P.ProtocolError as e:
        return error_response(400, str(e))
    except DuplicateRequestError as e:
        return error_response(400, f"rid: {e}")
    except QueueFullError as e:
        return error_response(503, str(e), {"Retry-After": str(RETRY_AFTER_S)})
    except EngineFailed as e:
        return error_response(e.status, str(e))
    except EngineDeadError as e:  # /health says 503 and the server exits: a supervisor restarts it
        return error_response(500, str(e))
    except web.HTTPException:
        raise
    except ConnectionResetError:  # the client went away; its request was aborted
        log.debug("%s %s: client closed the connection", request.method, request.path)
        raise
    except Exception as e:  # a bug, not a bad request: say so, keep serving
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, f"{type(e).__name__}: {e}")


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


# --- health and info ---------------------------------------------------------------------------

def _not_ready(st: ServerState) -> str:
    if "error" in st.warmup:
        return f"the start-up compilation failed: {st.warmup['error']}"
    return "warming up: compiling the engine's steps"


def _unhealthy(st: ServerState) -> web.Response | None:
    """A 503 when the server cannot generate: still compiling, or its engine is dead or stopped."""
    if not st.ready:
        return error_response(503, _not_ready(st))
    if not st.engine.alive:
        error = st.engine.error
        return error_response(503, "engine stopped" if error is None else f"engine dead: {error!r}")
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
                            rid=f"health-{uuid.uuid4().hex}")
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
                    return error_response(503, f"engine did not generate: {type(err).__name__}: {err}")
            if e.stats["generated_tokens"] > start:
                return web.Response(text="")
            left = deadline - time.monotonic()
            if left <= 0:
                why = "its probe was refused (full queue)" if refused else "its probe waits"
                return error_response(503, f"engine generated nothing in {st.health_timeout_s:g}s ({why})")
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
    state = {"num_running": e.num_running, "num_waiting": e.num_waiting,
             "num_slots": e.lane_slots * e.num_lanes, "free_slots": e.num_free_slots,
             "live_requests": e.num_live,
             "weight_version": st.weight_version, "engine_version": e.version, "paused": st.paused,
             "ready": st.ready, "warmup": st.warmup,
             "lanes": e.num_lanes, "random_seed": e.seed,
             "max_queued_requests": e.cfg.max_queued_requests,
             "chunked_prefill_size": e.cfg.chunked_prefill_size, "placement": e.placement(),
             **st.info}
    # data-parallel replicas (inference.replicas): one entry per rank, as SGLang reports dp
    per_rank = e.replica_states() if hasattr(e, "replica_states") else [{}]
    info = P.ServerInfo(
        model_path=st.model_path, tokenizer_path=st.tokenizer_path,
        served_model_name=st.served_model_name or st.model_path, max_context_length=e.max_seq_len,
        version=SERVER_VERSION, host=st.host, port=st.port,
        incremental_streaming_output=st.incremental_streaming_output, weight_update_mode=st.weight_update_mode,
        internal_states=[{**state, **rank} for rank in per_rank])
    # SGLang reports its server args and the KV pool's size (max_total_num_tokens) at the top level
    return json_response({**msgspec.to_builtins(info), **(e.server_info() if hasattr(e, "server_info") else {})})


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
    await st.wake_gate()
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
              incremental_streaming_output: bool = False, warmup: bool = False,
              weight_update_mode: str = "swap") -> web.Application:
    """The aiohttp app over ``engine``; with ``manage_engine`` it starts and stops the engine.
    ``weight_roots``: where ``/update_weights_from_disk`` may load from (default: the parent
    directory of ``model_path``; none without a model path). ``max_request_bytes`` bounds a JSON
    body, ``max_body_bytes`` a weight bucket; ``weight_transfer_timeout_s`` drops an unfinished
    bucketed transfer that went quiet.
    ``incremental_streaming_output``, ``weight_update_mode``: see ``ServerState``. With ``warmup``, the engine compiles
    every step shape (``Engine.warmup``) after the server starts listening and before it starts
    the engine; until then /health is a 503 and requests get a 503."""
    if weight_update_mode not in WEIGHT_UPDATE_MODES:
        raise ValueError(f"weight_update_mode must be one of {WEIGHT_UPDATE_MODES}, got {weight_update_mode!r}")
    if warmup and not manage_engine:
        raise ValueError("warmup needs manage_engine: the engine compiles before it starts")
    if weight_roots is None:
        weight_roots = [default_weight_root(model_path)] if model_path else []
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=max(max_body_bytes, max_request_bytes))
    st = ServerState(engine=engine, tokenizer=tokenizer, api_key=api_key, model_path=model_path,
                     tokenizer_path=tokenizer_path or model_path, served_model_name=served_model_name,
                     info=dict(info or {}), incremental_streaming_output=incremental_streaming_output,
                     weight_roots=resolve_weight_roots(weight_roots), max_request_bytes=max_request_bytes,
                     max_body_bytes=max_body_bytes,
                     weight_transfer_timeout_s=weight_transfer_timeout_s, weight_update_mode=weight_update_mode)
    st.relabel(weight_version)
    app[STATE] = st
    r = app.router
    r.add_post("/generate", generate_api.generate)
    for path, fn in (("/health", health), ("/health_generate", health_generate),
                     ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                     ("/get_server_info", get_server_info), ("/server_info", get_server_info),
                     ("/get_weight_version", get_weight_version), ("/weight_version", get_weight_version)):
        r.add_get(path, fn)
        r.add_post(path, fn)
    r.add_get("/metrics", metrics.metrics)
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
