"""The embedded JAX server: an aiohttp front that speaks SGLang's native API over an ``Engine``.

A rollout client cannot tell it from a real SGLang server for the endpoints in ``protocol``.
Errors in a request are HTTP 400 with ``{"error": {"message", "code"}}`` naming the field; a
weight load that fails answers ``success: false`` (HTTP 400, as SGLang does) and the old weights
keep serving. With an API key, every endpoint but ``/health`` and ``/health_generate`` wants
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from areal_jax.inference.types import GenerateOutput, GenerateRequest
from areal_jax.inference.types import SamplingParams as EngineSamplingParams
from rollout_bridge import protocol as P

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/health_generate"})
SERVER_VERSION = "areal-jax-0.1"


@dataclass
class _Staged:
    """Buckets of one /update_weights_from_tensor transfer, held until its last bucket."""

    transfer_id: str
    version: int
    next_bucket: int = 0
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


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
    paused: bool = False
    staged: _Staged | None = None
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


STATE = web.AppKey("state", ServerState)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=P.encode(obj), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status)


@web.middleware
async def _auth_and_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    st = request.app[STATE]
    if st.api_key and request.path not in OPEN_PATHS:
        got = request.headers.get("Authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {st.api_key}".encode()):
            return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
    try:
        return await handler(request)
    except P.ProtocolError as e:
        return _error(400, str(e))
    except web.HTTPException:
        raise
    except Exception as e:  # a bug, not a bad request: say so, keep serving
        log.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(e).__name__}: {e}")


# --- /generate ---------------------------------------------------------------------------------

def _engine_request(st: ServerState, req: P.GenerateReqInput) -> GenerateRequest:
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
        ignore_eos=sp.ignore_eos, seed=sp.sampling_seed,
    )
    try:
        esp.validate(engine.vocab_size)
    except ValueError as e:
        raise P.ProtocolError("sampling_params", str(e)) from None
    return GenerateRequest(input_ids=list(req.input_ids), sampling=esp, rid=req.rid or uuid.uuid4().hex,
                           return_logprob=req.return_logprob)


def _reply(st: ServerState, out: GenerateOutput, req: P.GenerateReqInput, t0: float) -> P.GenerateReqOutput:
    ids = list(out.output_ids)
    text = ""
    if st.tokenizer is not None and ids:
        text = st.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)
    versions = list(out.output_versions or [])
    meta = P.MetaInfo(
        id=out.rid, finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
        completion_tokens=len(ids), weight_version=str(out.weight_version),
        weight_versions=P.version_spans(versions) if len(versions) == len(ids) else [],
        output_token_logprobs=(
            [(float(lp), int(t), None) for lp, t in zip(out.output_logprobs, ids, strict=False)]
            if req.return_logprob else None),
        e2e_latency=time.perf_counter() - t0,
    )
    return P.GenerateReqOutput(text=text, output_ids=ids, meta_info=meta)


async def generate(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    t0 = time.perf_counter()
    req = P.decode(await request.read(), P.GenerateReqInput)
    ereq = _engine_request(st, req)
    if not req.stream:
        out = await st.engine.generate(ereq)
        return _json(_reply(st, out, req, t0))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    try:
        async for part in st.engine.stream(ereq):
            await resp.write(b"data: " + P.encode(_reply(st, part, req, t0)) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except (ConnectionResetError, asyncio.CancelledError):
        await asyncio.shield(st.engine.abort(ereq.rid))
        raise
    except Exception as e:  # the status line is gone; report in-band as SGLang does
        log.exception("stream %s failed", ereq.rid)
        await resp.write(b"data: " + P.encode({"error": {"message": f"{type(e).__name__}: {e}"}}) + b"\n\n")
    await resp.write_eof()
    return resp


# --- health and info ---------------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    """Healthy when the engine produces one token within the timeout (or is paused on purpose)."""
    st = request.app[STATE]
    if st.paused:
        return web.Response(text="")
    probe = GenerateRequest(input_ids=[0], sampling=EngineSamplingParams(max_new_tokens=1, temperature=0.0),
                            rid=f"health-{uuid.uuid4().hex}", return_logprob=False)
    try:
        await asyncio.wait_for(st.engine.generate(probe), st.health_timeout_s)
    except Exception as e:
        return _error(503, f"engine did not generate: {type(e).__name__}: {e}")
    return web.Response(text="")


async def get_model_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return _json(P.ModelInfo(model_path=st.model_path, tokenizer_path=st.tokenizer_path,
                             served_model_name=st.served_model_name or st.model_path,
                             weight_version=str(st.engine.version)))


async def get_server_info(request: web.Request) -> web.Response:
    st = request.app[STATE]
    e = st.engine
    return _json(P.ServerInfo(
        model_path=st.model_path, tokenizer_path=st.tokenizer_path,
        served_model_name=st.served_model_name or st.model_path, max_context_length=e.max_seq_len,
        version=SERVER_VERSION, host=st.host, port=st.port,
        internal_states=[{"num_running": e.num_running, "num_waiting": e.num_waiting,
                          "weight_version": str(e.version), "paused": st.paused, "lanes": e.num_lanes}]))


# --- control -----------------------------------------------------------------------------------

async def flush_cache(request: web.Request) -> web.Response:
    ok = await request.app[STATE].engine.flush_cache()
    if not ok:
        return web.Response(text="Cache not flushed: requests are running.", status=400)
    return web.Response(text="Cache flushed.")


async def abort_request(request: web.Request) -> web.Response:
    req = P.decode(await request.read(), P.AbortReqInput)
    if not req.abort_all and not req.rid:
        raise P.ProtocolError("rid", "give the rid to abort, or abort_all: true")
    n = await request.app[STATE].engine.abort(req.rid or None, abort_all=req.abort_all)
    return _json({"success": True, "num_aborted": n})


async def pause_generation(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = P.decode(await request.read(), P.PauseGenerationReqInput)
    await st.engine.pause(req.mode)
    st.paused = True
    return _json({"success": True, "message": f"Generation paused ({req.mode})."})


async def continue_generation(request: web.Request) -> web.Response:
    st = request.app[STATE]
    await st.engine.resume()
    st.paused = False
    return _json({"success": True, "message": "Generation continued."})


async def _apply(st: ServerState, version: int, *, tensors: dict[str, np.ndarray] | None = None,
                 model_dir: str | None = None, flush: bool = True) -> web.Response:
    try:
        await st.engine.update_weights(tensors, model_dir=model_dir, version=version)
    except Exception as e:  # the engine keeps the old weights serving
        log.warning("weight update to version %d failed: %s", version, e)
        return _json(P.UpdateWeightsResult(success=False, message=f"{type(e).__name__}: {e}",
                                           weight_version=str(st.engine.version)), 400)
    if flush:
        await st.engine.flush_cache()
    return _json(P.UpdateWeightsResult(success=True, message="Succeeded to update model weights.",
                                       weight_version=str(st.engine.version)))


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = P.decode(await request.read(), P.UpdateWeightsFromDiskReqInput)
    version = st.engine.version if req.weight_version is None else P.parse_version(req.weight_version)
    async with st.weight_lock:
        if req.abort_all_requests:
            await st.engine.abort(abort_all=True)
        return await _apply(st, version, model_dir=req.model_path, flush=req.flush_cache)


async def update_weight_version(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = P.decode(await request.read(), P.UpdateWeightVersionReqInput)
    version = P.parse_version(req.new_version, "new_version")
    async with st.weight_lock:
        if req.abort_all_requests:
            await st.engine.abort(abort_all=True)
        return await _apply(st, version, tensors={}, flush=False)


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """One bucket of a bucketed push (see ``protocol``); the last bucket applies them all."""
    st = request.app[STATE]
    if request.content_type != "application/octet-stream":
        raise P.ProtocolError("Content-Type", "send one bucket as safetensors bytes with "
                              "Content-Type: application/octet-stream (the JSON form is not served)")
    try:
        q = msgspec.convert(dict(request.query), P.TensorBucketParams, strict=False)
    except msgspec.ValidationError as e:
        raise P.ProtocolError("query", str(e)) from None
    version = P.parse_version(q.weight_version)
    body = await request.read()
    try:
        from safetensors.numpy import load

        tensors = load(body)
    except Exception as e:
        raise P.ProtocolError("body", f"not a safetensors buffer ({e})") from None
    async with st.weight_lock:
        staged = st.staged
        if q.bucket == 0:
            if staged is not None:
                log.warning("dropping unfinished weight transfer %s", staged.transfer_id)
            staged = st.staged = _Staged(q.transfer_id, version)
        elif staged is None or staged.transfer_id != q.transfer_id:
            raise P.ProtocolError("transfer_id", f"no transfer {q.transfer_id!r} in progress; start at bucket 0")
        if q.bucket != staged.next_bucket or version != staged.version:
            st.staged = None
            raise P.ProtocolError("bucket", f"expected bucket {staged.next_bucket} of version {staged.version}, "
                                  f"got bucket {q.bucket} of version {version}; transfer dropped")
        dup = sorted(set(tensors) & set(staged.tensors))
        if dup:
            st.staged = None
            raise P.ProtocolError("body", f"tensors {dup[:3]} sent twice in one transfer; transfer dropped")
        staged.tensors.update(tensors)
        staged.next_bucket += 1
        if not q.last:
            return _json(P.UpdateWeightsResult(success=True, message=f"staged bucket {q.bucket}",
                                               weight_version=str(st.engine.version)))
        st.staged = None
        if q.abort_all_requests:
            await st.engine.abort(abort_all=True)
        return await _apply(st, version, tensors=staged.tensors, flush=q.flush_cache)


# --- app -----------------------------------------------------------------------------------------

def build_app(engine: Any, tokenizer: Any = None, api_key: str | None = None, *, model_path: str = "",
              tokenizer_path: str | None = None, served_model_name: str = "",
              max_body_bytes: int = 4 * 1024**3, manage_engine: bool = True) -> web.Application:
    """The aiohttp app over ``engine``; with ``manage_engine`` it starts and stops the engine."""
    app = web.Application(middlewares=[_auth_and_errors], client_max_size=max_body_bytes)
    app[STATE] = ServerState(engine=engine, tokenizer=tokenizer, api_key=api_key, model_path=model_path,
                             tokenizer_path=tokenizer_path or model_path, served_model_name=served_model_name)
    r = app.router
    r.add_post("/generate", generate)
    for path, fn in (("/health", health), ("/health_generate", health_generate),
                     ("/get_model_info", get_model_info), ("/get_server_info", get_server_info)):
        r.add_get(path, fn)
        r.add_post(path, fn)
    r.add_post("/flush_cache", flush_cache)
    r.add_get("/flush_cache", flush_cache)
    r.add_post("/abort_request", abort_request)
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weight_version", update_weight_version)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    if manage_engine:
        async def _start(app: web.Application) -> None:
            await engine.start()

        async def _stop(app: web.Application) -> None:
            await engine.stop()

        app.on_startup.append(_start)
        app.on_cleanup.append(_stop)
    return app


async def start_server(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                       shutdown_timeout: float = 10.0) -> tuple[web.AppRunner, int]:
    """Serve ``app`` in this event loop; returns the runner (``await runner.cleanup()`` to stop,
    giving running requests ``shutdown_timeout`` seconds) and the bound port (useful with port 0)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp has no public getter
    st = app[STATE]
    st.host, st.port = host, bound
    return runner, bound


def _engine_config(**kw: Any) -> Any:
    from areal_jax.inference.engine import EngineConfig

    return EngineConfig(**{k: v for k, v in kw.items() if v is not None})


async def serve(model_path: str, host: str = "127.0.0.1", port: int = 30000, api_key: str | None = None, *,
                tokenizer_path: str | None = None, served_model_name: str = "", dtype: str | None = None,
                **engine_cfg: Any) -> None:
    """Load ``model_path`` and serve it until cancelled. ``engine_cfg`` goes to ``EngineConfig``."""
    from areal_jax.inference.engine import Engine
    from areal_jax.models import load_pretrained, load_tokenizer

    model = load_pretrained(model_path, dtype=dtype)
    tokenizer = load_tokenizer(tokenizer_path or model_path)
    engine = Engine(model, _engine_config(**engine_cfg), eos_token_ids=model.config.eos_token_ids)
    app = build_app(engine, tokenizer, api_key, model_path=model_path, tokenizer_path=tokenizer_path,
                    served_model_name=served_model_name)
    runner, bound = await start_server(app, host, port)
    log.info("serving %s on http://%s:%d", model_path, host, bound)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def parser() -> argparse.ArgumentParser:
    """SGLang's flag names for the options the embedded server has."""
    p = argparse.ArgumentParser("areal-jax serve", description="Serve a model over SGLang's native HTTP API")
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--served-model-name", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--max-running-requests", type=int, default=None, help="engine slots (decode batch)")
    p.add_argument("--context-length", type=int, default=None, help="max prompt + answer tokens")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--lanes", type=int, default=None,
                   help="slot groups decoded concurrently (not an SGLang flag); default: 2 on a multi-core CPU, else 1")
    p.add_argument("--log-level", default="info")
    return p


def run_server(args: argparse.Namespace | list[str] | None = None) -> None:
    """Entry point for ``areal-jax serve`` (argv list or parsed args)."""
    if not isinstance(args, argparse.Namespace):
        args = parser().parse_args(args)
    logging.basicConfig(level=args.log_level.upper())
    asyncio.run(serve(args.model_path, args.host, args.port, args.api_key, tokenizer_path=args.tokenizer_path,
                      served_model_name=args.served_model_name, dtype=args.dtype,
                      num_slots=args.max_running_requests, max_seq_len=args.context_length,
                      seed=args.random_seed, lanes=args.lanes))


if __name__ == "__main__":
    run_server()
