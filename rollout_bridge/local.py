"""The in-process rollout client: the JAX engine inside the trainer's own process.

A TPU host's chips belong to one process, and so does a notebook's accelerator: there, no HTTP
server can run beside the trainer. ``LocalRolloutClient`` drives an ``Engine`` in the trainer's
process and answers like ``HttpRolloutClient``: ``generate`` returns a ``GenerateResult`` with
per-token versions and logprobs, an answer aborted by a pause or a weight update is re-submitted
as prompt + tokens so far until it stops, and pause modes, continue and flush are the engine's.
Requests are checked by the same protocol rules as over HTTP, and refused with ``RolloutError``.
An engine error (an abort with a 5xx ``status_code``: a failed step) is not a pause: as over
HTTP, it is re-submitted at most ``max_error_resends`` times with a doubling wait, then raises
``RolloutError`` with the engine's message; a dead engine raises at once.

Weights are handed over on device (``update_params``): the trainer's params are placed on the
engine's shardings and cast to its dtypes, never through host memory. Two placements:

* ``shared``: trainer and engine on the same devices, taking turns. Where a param's dtype and
  layout already match the engine's, the engine serves the trainer's array itself (no copy), so
  the trainer must lend it (``trainer.policy.lend()``: the next update then does not donate it).
* ``split``: disjoint groups of this process's devices (``split_devices``; for example 4 chips
  train and 4 generate on a v5e-8), each with its own mesh shape. The engine generates while a
  train step runs. The handover changes the layout inside one jitted program on one group and
  moves whole shards between the groups, so the two device counts must divide one another.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import msgspec
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from areal_jax.inference.engine import PAUSE_MODES, Engine
from areal_jax.inference.types import EngineDeadError, GenerateRequest, QueueFullError
from areal_jax.inference.types import SamplingParams as EngineSamplingParams
from areal_jax.models.layer_stack import stacked_view
from rollout_bridge import protocol as P
from rollout_bridge import validation as V
from rollout_bridge.client import ClientConfig, GenerateResult, RolloutClient, RolloutError

__all__ = ["LOCAL", "HandoverMetrics", "LocalRolloutClient", "build_engine", "handover", "split_devices"]

LOCAL = "local"
"""The name the in-process engine goes by where an HTTP client would give a server URL."""

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """An answer being generated: the engine rid of its current segment, and whether the caller
    aborted it (checked before every re-submission, so an abort is never lost between them)."""

    sub: str | None = None
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def cancelled(self) -> bool:
        return self.aborted.is_set()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a back-off), or less if the caller aborts the answer meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.aborted.wait(), seconds)


@dataclass
class HandoverMetrics:
    """What one on-device weight handover cost."""

    version: int
    bytes: int
    """Bytes of the engine's params (its dtypes)."""
    copied_bytes: int
    """Of those, bytes cast or moved; the rest the engine now shares with the trainer (no copy)."""
    seconds: float
    """From the first param placed to the engine serving the new version."""
    tensors: int


def split_devices(devices: Sequence[jax.Device], engine_devices: int | None) -> tuple[list[jax.Device],
                                                                                    list[jax.Device]]:
    """``(trainer devices, engine devices)`` for the split placement: the last ``engine_devices``
    (None: half) generate, the others train; one count must divide the other (see ``handover``)."""
    devices = list(devices)
    n = len(devices) // 2 if engine_devices is None else engine_devices
    if not 0 < n < len(devices):
        raise ValueError(f"the split placement needs 1 to {len(devices) - 1} engine devices of this process's "
                         f"{len(devices)} ({devices[0].platform}); got {n}. One device: use the shared placement")
    if not _divides(len(devices) - n, n):
        raise ValueError(f"the split placement's {len(devices) - n} trainer and {n} engine devices must divide one "
                         f"another (the handover copies whole shards between them); choose rollout.local."
                         f"engine_devices among {[k for k in range(1, len(devices)) if _divides(k, len(devices) - k)]}")
    return devices[:-n], devices[-n:]


def _divides(a: int, b: int) -> bool:
    return a % b == 0 or b % a == 0


def build_engine(model_dir: str | Path, server_args: Sequence[str] = (), *, mesh: Any = None,
                 seed: int | None = None, fuse_projections: bool = False) -> Engine:
    """An engine for ``model_dir`` sized by ``areal-jax serve`` flags (``--max-running-requests``,
    ``--context-length``, ``--dtype``, ``--random-seed``, ...), on ``mesh`` (None: one device).
    ``fuse_projections``: q/k/v and gate/up as one matmul each, as ``areal-jax serve`` loads them
    (for an engine that takes HF-named tensors, not the trainer's own arrays: see ``handover``)."""
    from areal_jax.inference.config import EngineConfig
    from areal_jax.models import load_pretrained
    from rollout_bridge.serve import engine_config, parser

    args = parser().parse_args(["--model-path", str(model_dir), *server_args])
    if args.tp_size != 1 or args.dp_size != 1:
        raise ValueError("--tp-size / --dp-size do not apply to the in-process engine: its mesh comes from the "
                         "placement (rollout.local)")
    ways = 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
    if args.max_running_requests % ways:
        raise ValueError(f"--max-running-requests {args.max_running_requests} must be a multiple of {ways}: the "
                         f"engine's mesh {dict(mesh.shape)} splits its KV slots over data x fsdp")
    cfg = engine_config(args, args.context_length or EngineConfig.max_seq_len, data_parallel=ways > 1, seed=seed)
    model = load_pretrained(model_dir, dtype=args.dtype, mesh=mesh, fuse_projections=fuse_projections)
    return Engine(model, cfg, eos_token_ids=model.config.eos_token_ids, mesh=mesh)


def handover(params: Any, like: Any) -> tuple[Any, int]:
    """``params`` placed like ``like`` (an engine's state: the same parameters by path), device to
    device: a leaf whose dtype and layout already match is passed through as is; the others are
    cast and resharded onto ``like``'s shardings without a trip through host memory (see
    ``_place``). Returns the new state, in ``like``'s tree (its variables' metadata), and the
    bytes copied. Blocks until the arrays are in place.

    A ``like`` in the serving layout (``models.layer_stack``) is taken as the stacked arrays it
    stands for: the state returned is stacked, and ``set_state`` splits it into the engine's own
    layer buffers (no second copy of the layer parameters; an engine with ``--layer-layout
    stacked`` serves the handed-over arrays as they are)."""
    keystr = jax.tree_util.keystr
    like = stacked_view(like)
    given = {keystr(path): x for path, x in jax.tree_util.tree_leaves_with_path(params)}
    paths, olds = zip(*jax.tree_util.tree_leaves_with_path(like), strict=True)
    wanted = [keystr(p) for p in paths]
    if set(given) != set(wanted):
        diff = sorted(set(given) ^ set(wanted))
        raise ValueError(f"handover: the trainer's params and the engine's state differ in parameters {diff[:5]}; "
                         "load the engine from a checkpoint of the same model")
    leaves = [given[key] for key in wanted]
    moving: dict[tuple[Mesh, Mesh], list[int]] = {}  # (trainer mesh, engine mesh) -> leaves to place
    kept = []  # leaves that match: the same buffers, under the engine's sharding object
    for i, (key, x, old) in enumerate(zip(wanted, leaves, olds, strict=True)):
        if x.shape != old.shape:
            raise ValueError(f"handover: {key} is {x.shape} in the trainer but {old.shape} in the engine")
        if x.dtype != old.dtype or not x.sharding.is_equivalent_to(old.sharding, x.ndim):
            moving.setdefault((_mesh_and_spec(x.sharding)[0], _mesh_and_spec(old.sharding)[0]), []).append(i)
        elif x.sharding != old.sharding:
            kept.append(i)
    # The engine's steps were compiled for its own sharding objects: an equivalent but different
    # one (a one-device mesh for a single device) would compile them again. This re-wraps the
    # buffers, it does not copy them.
    for i, y in zip(kept, jax.device_put([leaves[i] for i in kept], [olds[i].sharding for i in kept]), strict=True):
        leaves[i] = y
    for idx in moving.values():
        placed = _place([leaves[i] for i in idx], [olds[i].sharding for i in idx], [olds[i].dtype for i in idx])
        for i, y in zip(idx, placed, strict=True):
            leaves[i] = y
    state = jax.tree.unflatten(jax.tree.structure(like), leaves)
    return jax.block_until_ready(state), sum(olds[i].size * np.dtype(olds[i].dtype).itemsize
                                             for idx in moving.values() for i in idx)


_COPIES = "handover_copies"
"""The mesh axis over which ``_place`` keeps copies of each shard when device counts differ."""


def _place(xs: list[jax.Array], shardings: list[Sharding], dtypes: list[Any]) -> list[jax.Array]:
    """``xs`` (on one mesh) cast to ``dtypes`` and placed on ``shardings`` (on one mesh).

    ``jax.device_put`` onto other devices in another layout reads each array to host and writes
    it back (JAX's slow path, where no source shard holds a slice the destination needs). So the
    layout changes inside a jit on one device set, and the move between device sets copies whole
    shards in one layout: on as many engine devices or fewer, the trainer reshards into the
    engine's layout (cast first: fewer bytes to move) and the shards are copied; on more, the
    trainer's shards are copied in its layout (several copies of each) and the engine's devices
    reshard. The same devices in another order are the first case, the copy a reordering."""
    src, dst = _mesh_and_spec(xs[0].sharding)[0], _mesh_and_spec(shardings[0])[0]
    if tuple(src.devices.flat) == tuple(dst.devices.flat):  # shared: reshard where the arrays are
        return _cast_to(tuple(shardings), tuple(dtypes))(xs)
    n_src, n_dst = src.devices.size, dst.devices.size
    if n_src % n_dst == 0:
        mid_mesh = Mesh(src.devices.reshape(n_src // n_dst, *dst.devices.shape), (_COPIES, *dst.axis_names))
        mid = _cast_to(tuple(NamedSharding(mid_mesh, _mesh_and_spec(s)[1]) for s in shardings), tuple(dtypes))(xs)
        return jax.device_put(mid, shardings)
    if n_dst % n_src == 0:
        mid_mesh = Mesh(dst.devices.reshape(n_dst // n_src, *src.devices.shape), (_COPIES, *src.axis_names))
        mid = jax.device_put(xs, [NamedSharding(mid_mesh, _mesh_and_spec(x.sharding)[1]) for x in xs])
        return _cast_to(tuple(shardings), tuple(dtypes))(mid)
    raise ValueError(f"handover: the trainer's {n_src} devices and the engine's {n_dst} do not divide one another; "
                     "the handover copies whole shards between them (rollout.local.engine_devices)")


@functools.lru_cache(maxsize=16)
def _cast_to(shardings: tuple[Sharding, ...], dtypes: tuple[Any, ...]) -> Any:
    """One jitted function that casts a list of arrays and lays them out on ``shardings`` (cached:
    every handover of a run reuses the compiled program)."""
    def cast(xs: list[jax.Array]) -> list[jax.Array]:
        return [x.astype(d) for x, d in zip(xs, dtypes, strict=True)]
    return jax.jit(cast, out_shardings=list(shardings))


def _mesh_and_spec(sharding: Sharding) -> tuple[Mesh, PartitionSpec]:
    """A sharding as mesh and spec; a single device is a one-device mesh."""
    if isinstance(sharding, NamedSharding):
        return sharding.mesh, sharding.spec
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return Mesh(np.array([device]), ("device",)), PartitionSpec()
    raise ValueError(f"handover: arrays must be on a NamedSharding or one device, not {sharding}")


class LocalRolloutClient(RolloutClient):
    """``RolloutClient`` over an in-process ``Engine`` (see the module docstring). ``config``
    brings the re-send bound and the back-off of a full queue; its timeouts do not apply.

    It answers ``HttpRolloutClient``'s calls with the same names, arguments and reply shapes
    (one reply, from ``"local"``): generation, ``abort``, pause modes, ``continue_generation``,
    ``flush_cache``, ``update_weights_from_disk``, ``update_weight_version``, ``check_health``,
    the version records and ``get_model_info``; ``check_versions`` has nothing to check (the
    engine cannot restart behind the client's back). Left out on purpose, as they only mean
    something over HTTP: ``push_tensor_bucket`` (use ``update_weights_from_tensors`` or, on
    device, ``update_params``), the ``servers`` records, the HTTP sessions and the health loop.
    """

    def __init__(self, engine: Engine, *, config: ClientConfig | None = None, manage_engine: bool = True):
        self.engine = engine
        self.cfg = config or ClientConfig()
        self.manage_engine = manage_engine
        self.last_handover: HandoverMetrics | None = None
        self._live: dict[str, _Live] = {}  # rid -> the answer being generated

    async def start(self) -> None:
        if self.manage_engine:
            await self.engine.start()

    async def close(self) -> None:
        if self.manage_engine:
            await self.engine.stop()

    async def __aenter__(self) -> LocalRolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- generation --

    def _sampling(self, input_ids: list[int], sampling_params: dict[str, Any] | None) -> P.SamplingParams:
        """SGLang-named params checked by the HTTP server's rules; a bad one raises ``RolloutError``."""
        try:
            sp = msgspec.convert(dict(sampling_params or {}), P.SamplingParams)
            V.validate_generate(P.GenerateReqInput(input_ids=input_ids, sampling_params=sp),
                                vocab_size=self.engine.vocab_size, context_length=self.engine.max_seq_len)
        except (msgspec.ValidationError, P.ProtocolError) as e:
            raise RolloutError(f"the local engine rejected the request: {e}") from None
        return sp

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       rid: str | None = None, session: str | None = None) -> GenerateResult:
        """Generate until stop or length, re-submitting after aborts (see the module docstring);
        ``session`` changes nothing here (one engine holds every turn's pages)."""
        prompt = list(input_ids)
        sp = self._sampling(prompt, sampling_params)
        budget = sp.max_new_tokens
        rid = rid or uuid.uuid4().hex
        if rid in self._live:
            raise RolloutError(f"request {rid} is already being generated; give each request its own rid")
        out: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish: dict[str, Any] = {"type": "length", "length": budget}
        attempt = busy = errors = 0
        live = self._live[rid] = _Live()
        try:
            while len(out) < budget or budget == 0:
                if live.cancelled:  # aborted between two segments
                    finish = {"type": "abort", "message": "aborted by the client"}
                    break
                if attempt > self.cfg.max_resends:
                    raise RolloutError(f"request {rid}: gave up after {self.cfg.max_resends} re-sends")
                sub_rid = rid if attempt == 0 else f"{rid}-r{attempt}"
                req = GenerateRequest(prompt + out, EngineSamplingParams(
                    max_new_tokens=budget - len(out), temperature=sp.temperature, top_p=sp.top_p,
                    top_k=-1 if sp.top_k >= P.CONTEXT_UNLIMITED_TOP_K else sp.top_k,
                    stop_token_ids=list(sp.stop_token_ids) if sp.stop_token_ids else None,
                    ignore_eos=sp.ignore_eos, seed=sp.sampling_seed), rid=sub_rid)
                attempt += 1
                live.sub = sub_rid  # admitted before the first await: an abort from now reaches it
                try:
                    res = await self.engine.generate(req)
                except QueueFullError:  # as a 503 over HTTP: wait and re-submit
                    busy += 1
                    await live.sleep(self.cfg.busy_backoff_s * 2 ** min(busy - 1, 3))
                    continue
                except EngineDeadError as e:
                    raise RolloutError(f"request {rid}: {e}") from None
                finally:
                    live.sub = None
                busy = 0
                out += res.output_ids
                logprobs += res.output_logprobs
                versions += res.output_versions
                finish = res.finish_reason
                if finish.get("type") != "abort" or live.cancelled or budget == 0:
                    break
                code = int(finish.get("status_code") or 0)
                if code >= 500:  # the engine failed it: not a pause
                    errors += 1
                    if errors > self.cfg.max_error_resends:
                        raise RolloutError(f"request {rid}: the local engine failed it: {finish.get('message')} "
                                           f"(gave up after {errors} engine errors)")
                    log.warning("request %s: the local engine failed it (%s); re-submitting (error %d of at most "
                                "%d)", rid, finish.get("message"), errors, self.cfg.max_error_resends + 1)
                    await live.sleep(min(self.cfg.error_backoff_s * 2 ** (errors - 1), 30.0))
                # Else aborted by a pause or a weight update: re-submit what we have; it waits in
                # the engine's queue until generation continues.
            if len(out) >= budget and finish.get("type") == "abort":
                finish = {"type": "length", "length": budget}
        finally:
            del self._live[rid]
        if finish.get("type") == "length":
            finish = {"type": "length", "length": len(out)}
        return GenerateResult(rid=rid, input_ids=prompt, output_ids=out, output_logprobs=logprobs,
                              output_versions=versions, finish_reason=finish, resends=attempt - 1)

    async def abort(self, rid: str) -> None:
        """Stop one request for good: it returns what it has with an abort finish reason. A rid
        not being generated is ignored (nothing is kept for it)."""
        live = self._live.get(rid)
        if live is None:
            return
        live.aborted.set()
        if live.sub is not None:
            await self.engine.abort(live.sub)

    # -- control --

    async def pause(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise RolloutError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self.engine.pause(mode)

    async def continue_generation(self) -> None:
        await self.engine.resume()

    async def flush_cache(self) -> None:
        if not await self.engine.flush_cache():
            raise RolloutError("/flush_cache: requests are running; flush between runs or while paused and idle")

    # -- weights and versions --

    async def update_params(self, params: Any, *, version: int) -> HandoverMetrics:
        """Serve the trainer's ``params`` (an ``nnx.State`` like the engine's) as ``version``,
        handed over on device (see ``handover``). In the shared placement the engine may keep the
        very arrays given: take them with ``trainer.policy.lend()`` so no update donates them."""
        t0 = time.perf_counter()
        state, copied = await asyncio.to_thread(handover, params, self.engine.state)
        await self.engine.set_state(state, version=version)
        leaves = jax.tree.leaves(state)
        self.last_handover = HandoverMetrics(version=version, bytes=sum(x.nbytes for x in leaves),
                                             copied_bytes=copied, seconds=time.perf_counter() - t0,
                                             tensors=len(leaves))
        return self.last_handover

    async def update_weights_from_tensors(self, tensors: dict[str, Any], *, version: int) -> list[dict[str, Any]]:
        """HF-named host tensors (any subset) as ``version``: the path through host memory."""
        await self.engine.update_weights(tensors, version=version)
        return self._replies()

    async def update_weights_from_disk(self, model_path: str, *, version: int, abort_all_requests: bool = False,
                                       flush_cache: bool = True) -> list[dict[str, Any]]:
        """Load the HF checkpoint at ``model_path`` as ``version``. As the HTTP server does, the
        cache is then flushed if asked and nothing is running (refused silently otherwise)."""
        if abort_all_requests:
            await self.engine.abort(abort_all=True)
        await self.engine.update_weights(model_dir=model_path, version=version)
        if flush_cache:
            await self.engine.flush_cache()
        return self._replies()

    async def update_weight_version(self, version: int, *, abort_all_requests: bool = False) -> list[dict[str, Any]]:
        """Serve the same weights as ``version`` (a relabel: tokens sampled from now on carry it)."""
        if abort_all_requests:
            await self.engine.abort(abort_all=True)
        await self.engine.set_state(self.engine.state, version=version)
        reply = {"success": True, "message": f"Weight version updated to {str(version)!r}.",
                 "new_version": str(version)}
        return [{"server": LOCAL, "status": 200, "reply": reply}]

    @property
    def current_version(self) -> int:
        return self.engine.version

    def server_versions(self) -> dict[str, int]:
        """``{"local": version}``: the one engine and the policy version it serves."""
        return {LOCAL: self.engine.version}

    async def versions(self) -> dict[str, int]:
        return self.server_versions()

    async def reported_versions(self) -> dict[str, str | None]:
        """``{"local": label}``: the version the engine reports, as a label like a server's."""
        return {LOCAL: str(self.engine.version)}

    async def check_versions(self) -> None:
        """Nothing to check: the client's record is the engine's own version."""

    async def check_health(self) -> list[bool]:
        """``[alive]``: whether the engine runs (started, its loops going), as one server's health."""
        return [self.engine.alive]

    def in_rotation(self) -> list[str]:
        return [LOCAL]

    async def get_model_info(self) -> list[dict[str, Any]]:
        """As ``HttpRolloutClient.get_model_info``: one reply whose ``weight_version`` is the
        served policy version."""
        return self._replies()

    def _replies(self) -> list[dict[str, Any]]:
        reply = {"success": True, "weight_version": str(self.engine.version)}
        return [{"server": LOCAL, "status": 200, "reply": reply}]
