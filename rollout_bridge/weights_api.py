"""The embedded server's weight endpoints: ``/update_weights_from_disk``, ``/update_weight_version``
and our bucketed ``/update_weights_from_tensor`` with its ``/commit_weights`` (see ``protocol``).

By default (``weight_update_mode="swap"``) an update does not wait for the requests in flight:
they go on under the new weights from the next step, and their replies say which tokens each
version sampled (``meta_info.weight_versions``): what asynchronous RL wants, no answer waits for
an update or is thrown away. With ``weight_update_mode="drain"`` (``--weight-update-mode drain``)
an update behaves as SGLang's, which take its model-update lock: new requests wait, the update
waits for those in flight to finish, so no answer crosses versions (a paused server is not
drained). Either way, a caller that wants answers cut at the update pauses first
(``/pause_generation``, or ``/commit_weights`` with ``pause_mode``).

A new version is read and converted while the engine keeps generating and swapped in between
steps (a bucketed transfer only once every tensor of the model arrived, unless it says
``partial``); it is served under the label the request names (any string, as in SGLang; none keeps the
current label) while the engine counts updates in its own integer version. A load that fails
answers ``success: false`` with HTTP 400 and the old weights keep serving.

``/update_weights_from_disk`` loads only from a directory under the server's weight roots
(``--weight-roots``; by default the directory holding the served model), checked after symlinks
and ``..`` are resolved, and the resolved path is what is loaded. A path outside the roots and a
path that does not exist get the same answer, so a caller learns nothing about the filesystem
outside them. A bucketed transfer that gets no bucket for ``weight_transfer_timeout_s`` is
dropped with its tensors.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from aiohttp import web

from areal_jax.models.hf_io import CheckpointError
from rollout_bridge import protocol as P
from rollout_bridge.state import STATE, ServerState, json_response

log = logging.getLogger("rollout_bridge.server")


@dataclass
class _Staged:
    """One /update_weights_from_tensor transfer in progress: its buckets are checked as they come
    and converted onto the devices in the background, one after another, while the next bucket
    travels; the last bucket waits for them and swaps the new weights in."""

    transfer_id: str
    label: str
    stage: Any
    """The engine's ``WeightStage`` for this transfer."""
    next_bucket: int = 0
    work: asyncio.Future | None = None
    """The conversion of the buckets staged so far (each chained after the one before)."""
    timer: Any = None
    """The pending ``loop.call_later`` that drops this transfer if no bucket follows in time."""

    def convert(self, tensors: dict[str, np.ndarray]) -> None:
        """Convert ``tensors`` (checked) after the buckets before them, in a worker thread."""
        before, stage = self.work, self.stage

        async def run() -> None:
            if before is not None:
                await before
            await asyncio.to_thread(stage.add, tensors, checked=True)

        self.work = asyncio.ensure_future(run())


@dataclass
class _Held:
    """A transfer sent with ``hold``: its weights, prepared to serve, until ``/commit_weights``."""

    transfer_id: str
    label: str
    state: Any


def _drop(st: ServerState, staged: _Staged | None, why: str) -> None:
    if staged is None:
        return
    if staged.timer is not None:
        staged.timer.cancel()
    if st.staged is staged:
        st.staged = None
    if why:
        log.warning("dropping unfinished weight transfer %s (%d tensors): %s", staged.transfer_id,
                    len(staged.stage.received), why)
    if staged.work is not None and why:  # its conversion's outcome no longer matters
        staged.work.add_done_callback(lambda f: f.cancelled() or f.exception())


def _arm_timeout(st: ServerState, staged: _Staged) -> None:
    if staged.timer is not None:
        staged.timer.cancel()
    staged.timer = asyncio.get_running_loop().call_later(
        st.weight_transfer_timeout_s, _drop, st, staged,
        f"no bucket for {st.weight_transfer_timeout_s:g}s")


async def drop_staged(app: web.Application) -> None:
    """On cleanup: an unfinished transfer and its timer go."""
    st = app[STATE]
    _drop(st, st.staged, "server stopping")


def resolve_model_dir(st: ServerState, path: Any) -> str | None:
    """``path`` resolved, if it is an existing directory under one of the weight roots (a URL:
    under a URL root, without ``..``); else None, whether it is outside them or missing."""
    if not isinstance(path, str) or not path or "\x00" in path:
        return None
    if "://" in path:
        if ".." in path.split("://", 1)[1].split("/"):
            return None
        url_roots = [r for r in st.weight_roots if "://" in r]
        return path if any(path.rstrip("/").startswith(r + "/") for r in url_roots) else None
    real = os.path.realpath(path)
    local_roots = [r for r in st.weight_roots if "://" not in r]
    if not any(real == r or real.startswith(r.rstrip(os.sep) + os.sep) for r in local_roots):
        return None
    return real if os.path.isdir(real) else None


async def _apply(st: ServerState, label: str | None, *, stage: Any = None, model_dir: str | None = None,
                 state: Any = None, flush: bool = True) -> web.Response:
    """New weights under ``label`` (None keeps the current label, as SGLang does): from a
    ``stage`` or a ``model_dir``, or a ``state`` the engine already prepared."""
    label = st.weight_version if label is None else label
    t0 = time.perf_counter()
    try:
        async with st.updating():  # drain mode: the requests in flight finish first
            if state is not None:
                await st.engine.swap_weights(state, version=st.engine.version + 1)
            else:
                await st.engine.update_weights(model_dir=model_dir, stage=stage, version=st.engine.version + 1)
    except Exception as e:  # the engine keeps the old weights serving
        log.warning("weight update to %r failed: %s", label, e)
        return json_response(P.UpdateWeightsResult(success=False, message=f"{type(e).__name__}: {e}",
                                           weight_version=st.weight_version), 400)
    st.relabel(label)
    t1 = time.perf_counter()
    if flush:
        await st.engine.flush_cache()
    how = ("read and swapped" if model_dir is not None else "held weights swapped" if state is not None
           else "last bucket applied")
    log.info("serving weights %r (update %d; %s in %.3f s, cache flushed in %.3f s)", label, st.engine.version,
             how, t1 - t0,
             time.perf_counter() - t1)
    return json_response(P.UpdateWeightsResult(success=True, message="Succeeded to update model weights.",
                                       weight_version=st.weight_version))


async def update_weights_from_disk(request: web.Request) -> web.Response:
    st = request.app[STATE]
    req = P.decode(await request.read(), P.UpdateWeightsFromDiskReqInput)
    async with st.weight_lock:
        if req.abort_all_requests:
            await st.engine.abort(abort_all=True)
        model_dir = resolve_model_dir(st, req.model_path)
        if model_dir is None:
            return json_response(P.UpdateWeightsResult(
                success=False, message=f"model_path {req.model_path!r} is not a model directory under this "
                "server's weight roots (--weight-roots)", weight_version=st.weight_version), 400)
        return await _apply(st, req.weight_version, model_dir=model_dir, flush=req.flush_cache)


async def update_weight_version(request: web.Request) -> web.Response:
    """Relabel the weights being served (SGLang: the label only; nothing is reloaded)."""
    st = request.app[STATE]
    req = P.decode(await request.read(), P.UpdateWeightVersionReqInput)
    async with st.weight_lock:
        if req.abort_all_requests:
            await st.engine.abort(abort_all=True)
        async with st.updating():
            st.relabel(req.new_version)
    return json_response({"success": True, "message": f"Weight version updated to {req.new_version!r}.",
                  "new_version": req.new_version})


async def _read_body(request: web.Request) -> bytes | bytearray:
    """The body: with a ``Content-Length`` (the middleware already refused one over the bound), read
    into one buffer of that size as it arrives; ``request.read()`` gathers the pieces and copies
    them again, at about half the speed. A chunked body goes through ``read()``, bounded."""
    n = request.content_length
    if n is None:
        return await request.read()
    body = bytearray(n)
    view, got = memoryview(body), 0
    while got < n:
        chunk = await request.content.readany()
        if not chunk:
            break
        view[got:got + len(chunk)] = chunk
        got += len(chunk)
    if got != n:
        raise P.ProtocolError("body", f"{got} bytes arrived of the {n} the Content-Length announced")
    return body


def _decode_bucket(body: bytes | bytearray) -> dict[str, np.ndarray]:
    """The bucket's tensors; a malformed buffer (truncated, a header of the wrong shape) is a 400."""
    try:
        return P.decode_tensor_bucket(body)
    except P.ProtocolError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise P.ProtocolError("body", f"not a valid safetensors buffer ({type(e).__name__}: {e})") from None


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """One bucket of a bucketed push (see ``protocol``); the last bucket applies them all."""
    st = request.app[STATE]
    if request.content_type == "application/json":
        P.decode(await request.read(), P.UpdateWeightsFromTensorReqInput)
        return _refused("tensor")
    if request.content_type != "application/octet-stream":
        raise P.ProtocolError("Content-Type", "send one bucket as safetensors bytes with "
                              "Content-Type: application/octet-stream")
    try:
        q = msgspec.convert(dict(request.query), P.TensorBucketParams, strict=False)
    except msgspec.ValidationError as e:
        raise P.ProtocolError("query", str(e)) from None
    label = q.weight_version
    tensors = _decode_bucket(await _read_body(request))
    async with st.weight_lock:
        staged = st.staged
        if q.bucket == 0:
            _drop(st, staged, f"transfer {q.transfer_id} started")
            staged = st.staged = _Staged(q.transfer_id, label, st.engine.stage_weights(hf_layout=q.layout == "hf"))
        elif staged is None or staged.transfer_id != q.transfer_id:
            raise P.ProtocolError("transfer_id", f"no transfer {q.transfer_id!r} in progress (an unfinished "
                                  "transfer is dropped when it goes quiet); start at bucket 0")
        _arm_timeout(st, staged)
        if q.bucket != staged.next_bucket or label != staged.label:
            _drop(st, staged, "bucket out of order")
            raise P.ProtocolError("bucket", f"expected bucket {staged.next_bucket} of version {staged.label!r}, "
                                  f"got bucket {q.bucket} of version {label!r}; transfer dropped")
        began = "hf" if staged.stage.hf_layout else "native"
        if q.layout != began:
            _drop(st, staged, "layout changed")
            raise P.ProtocolError("layout", f"bucket {q.bucket} says layout={q.layout!r}, the transfer began "
                                  f"with {began!r}; send one transfer in one layout; transfer dropped")
        try:
            staged.stage.check(tensors)
        except CheckpointError as e:
            _drop(st, staged, str(e))
            return json_response(P.UpdateWeightsResult(success=False, message=f"{e}; transfer dropped",
                                                       weight_version=st.weight_version), 400)
        staged.convert(tensors)
        staged.next_bucket += 1
        if not q.last:
            return json_response(P.UpdateWeightsResult(success=True, message=f"staged bucket {q.bucket}",
                                               weight_version=st.weight_version))
        _drop(st, staged, "")  # finished: the timer goes, the staged weights are applied below
        try:
            await staged.work
        except Exception as e:  # the engine keeps the old weights serving
            log.warning("weight update to %r failed: %s", label, e)
            return json_response(P.UpdateWeightsResult(success=False, message=f"{type(e).__name__}: {e}",
                                                       weight_version=st.weight_version), 400)
        missing = staged.stage.missing()
        if missing and not q.partial:  # a version is every tensor, or says it is not
            return json_response(P.UpdateWeightsResult(
                success=False, message=f"{len(missing)} tensors missing from transfer {q.transfer_id!r} (e.g. "
                f"{missing[:3]}); send every tensor, or mark a partial update with partial=true; transfer dropped",
                weight_version=st.weight_version), 400)
        if q.hold:
            try:
                state = await st.engine.prepare_weights(stage=staged.stage)
            except Exception as e:  # nothing held; the old weights keep serving
                log.warning("weight transfer %s for %r failed: %s", q.transfer_id, label, e)
                return json_response(P.UpdateWeightsResult(success=False, message=f"{type(e).__name__}: {e}",
                                                           weight_version=st.weight_version), 400)
            st.held = _Held(q.transfer_id, label, state)
            return json_response(P.UpdateWeightsResult(
                success=True, message=f"weights {label!r} held; POST /commit_weights to serve them",
                weight_version=st.weight_version))
        if q.abort_all_requests:
            await st.engine.abort(abort_all=True)
        return await _apply(st, label, stage=staged.stage, flush=q.flush_cache)


async def hold_stage(st: ServerState, transfer_id: str, label: str, stage: Any) -> None:
    """Hold a ``stage`` (``engine.stage_weights()``) filled in this process, not over HTTP, as a
    transfer sent with ``hold`` would be held: ``/commit_weights`` with ``transfer_id`` and
    ``label`` then serves it (a pod's hosts each stage their own gathered copy of the trainer's
    weights this way, and process 0 commits them all as one version). Raises, holding nothing,
    if a tensor is missing or the weights do not build."""
    missing = stage.missing()
    if missing:
        raise CheckpointError(f"{len(missing)} tensors missing from transfer {transfer_id!r} (e.g. {missing[:3]})")
    async with st.weight_lock:
        state = await st.engine.prepare_weights(stage=stage)
        st.held = _Held(transfer_id, label, state)


def _refused(form: str) -> web.Response:
    """SGLang's failed-update reply (400, ``success: false``) saying why ``form`` is not served."""
    return json_response(P.UpdateWeightsResult(success=False, message=P.WEIGHTS_JSON_REFUSED[form]), 400)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """SGLang's NCCL weight broadcast: a well-formed request is refused, saying why (400)."""
    P.decode(await request.read(), P.UpdateWeightsFromDistributedReqInput)
    return _refused("distributed")


async def init_weights_update_group(request: web.Request) -> web.Response:
    P.decode(await request.read(), P.InitWeightsUpdateGroupReqInput)
    return _refused("distributed")


async def commit_weights(request: web.Request) -> web.Response:
    """Serve the weights of a transfer sent with ``hold`` (see ``protocol``): only the swap is
    left to do, inside a pause of its own when ``pause_mode`` asks for one."""
    st = request.app[STATE]
    req = P.decode(await request.read(), P.CommitWeightsReqInput)
    async with st.weight_lock:
        held = st.held
        if held is None or held.transfer_id != req.transfer_id or held.label != req.weight_version:
            have = "none" if held is None else f"transfer {held.transfer_id!r} of version {held.label!r}"
            raise P.ProtocolError("transfer_id", f"no held transfer {req.transfer_id!r} of version "
                                  f"{req.weight_version!r} (this server holds {have}); send the version again")
        st.held = None
        own_pause = req.pause_mode is not None and not st.paused  # a client's pause stays
        if own_pause:
            await st.engine.pause(req.pause_mode)
        try:
            return await _apply(st, held.label, state=held.state, flush=req.flush_cache)
        finally:
            if own_pause:
                await st.engine.resume()


# --- app -----------------------------------------------------------------------------------------


def add_routes(app: web.Application) -> None:
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    app.router.add_post("/commit_weights", commit_weights)
    app.router.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    app.router.add_post("/init_weights_update_group", init_weights_update_group)
