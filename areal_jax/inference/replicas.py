"""Data parallelism as SGLang runs it: ``dp`` replicas of an engine behind one engine API.

SGLang's ``--dp-size`` starts one scheduler per data-parallel rank, each with its own devices
(tensor parallelism within), its own KV pool and its own ``--max-running-requests`` and
``--max-total-tokens``, and one HTTP server in front that routes each request to a rank and fans
control out to all of them. ``ReplicaEngine`` is that front for our engines: it presents
``Engine``'s API (generate, stream, abort, pause, weight updates, ...) over N engines, each built
on its own group of ``tp`` devices, so the HTTP server and the engines need not know.

- **Routing.** A new request goes to the replica that already holds a live request with the same
  prompt (a GRPO group's answers then share one prefill and one copy of its pages) while that
  replica can still run it at once; otherwise to the least loaded replica: fewest live requests
  (running + waiting), then most free KV pages.
- **Fan-out.** Pause, resume, abort-all, flush and weight updates reach every replica. A weight
  update is prepared (read, checked, converted) on every replica before any swaps, so either all
  serve the new version or none does; two updates never interleave across replicas. Each token
  keeps the version of the replica that made it, and every replica holds the same version after
  an update returns.
- **Seeds.** Replica ``i`` draws unseeded requests from seed ``seed + i``: each numbers its
  requests from 1, and equal seeds would give two requests on two replicas the same samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from areal_jax.inference.config import EngineConfig
from areal_jax.inference.engine import Engine
from areal_jax.inference.types import DuplicateRequestError, GenerateOutput, GenerateRequest
from areal_jax.inference.weights import check_swappable
from areal_jax.models.decoder import Decoder
from areal_jax.models.layer_stack import split_layers

__all__ = ["ReplicaEngine", "ReplicaStage", "replica_pool_tokens"]


def replica_pool_tokens(cfg: EngineConfig, model: Decoder, dp_size: int, platform: str) -> int:
    """The KV pool of one replica, in tokens, as SGLang sizes one data-parallel rank's: the pool
    one engine would get on the replica's devices (``pool_size.pool_tokens``: ``max_total_tokens``,
    or sized from memory). On a CPU the replicas share one host's memory, so a pool sized from
    memory is that share divided by ``dp_size``; a given ``max_total_tokens`` is per replica."""
    from areal_jax.inference.pool_size import pool_tokens

    tokens = pool_tokens(cfg, model)
    from_memory = cfg.max_total_tokens is None or cfg.mem_fraction_static is not None
    if platform == "cpu" and from_memory and dp_size > 1:
        tokens = max(cfg.page_size, tokens // dp_size // cfg.page_size * cfg.page_size)
        if cfg.max_total_tokens is not None:
            tokens = min(tokens, cfg.max_total_tokens)
    return tokens


class ReplicaStage:
    """A bucketed weight push staged on every replica (``Engine.stage_weights`` of each): checked
    once, converted onto each replica's devices as the parts arrive."""

    def __init__(self, stages: Sequence[Any]) -> None:
        self.stages = list(stages)
        self.hf_layout = self.stages[0].hf_layout

    @property
    def received(self) -> set[str]:
        return self.stages[0].received

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        self.stages[0].check(tensors)  # the replicas serve one model: one check holds for all

    def add(self, tensors: Mapping[str, np.ndarray], *, checked: bool = False) -> None:
        if not checked:
            self.check(tensors)
        for stage in self.stages:
            stage.add(tensors, checked=True)

    def missing(self) -> list[str]:
        return self.stages[0].missing()



def _total(name: str) -> property:
    """A read-only property: the sum of attribute ``name`` over ``self.replicas``."""
    return property(lambda self: sum(getattr(r, name) for r in self.replicas))

class ReplicaEngine:
    """``Engine``'s API over data-parallel replicas (see the module docstring). Build one with
    ``ReplicaEngine.build``, or wrap engines made elsewhere (each on its own devices)."""

    def __init__(self, replicas: Sequence[Engine], *, seed: int | None = None, tp_size: int = 1,
                 max_total_tokens: int | None = None) -> None:
        if not replicas:
            raise ValueError("ReplicaEngine needs at least one replica")
        self.replicas = list(replicas)
        self.seed = self.replicas[0].seed if seed is None else seed
        self.tp_size = tp_size
        self._max_total_tokens = max_total_tokens
        self._where: dict[str, int] = {}
        """rid -> replica of every request admitted and not yet returned (routing of aborts)."""
        self._homes: list[Counter] = [Counter() for _ in self.replicas]
        """Per replica: how many live requests have each prompt (by its token tuple)."""
        self._update_lock = asyncio.Lock()

    @classmethod
    def build(cls, load_model: Callable[[Any], Decoder], cfg: EngineConfig, *, dp_size: int, tp_size: int = 1,
              devices: Sequence[Any] | None = None, eos_token_ids: list[int] | None = None,
              version: int = 0) -> ReplicaEngine:
        """``dp_size`` engines of ``cfg`` (each with ``cfg.num_slots`` running requests and its own
        pool), replica ``i`` on devices ``[i * tp_size, (i + 1) * tp_size)`` of ``devices``
        (default: this host's), sharded over a tensor axis of ``tp_size`` within.
        ``load_model(mesh)`` loads the served model onto a replica's mesh."""
        from sharding import MeshConfig, make_mesh

        devices = list(jax.local_devices() if devices is None else devices)
        if dp_size < 1 or tp_size < 1:
            raise ValueError(f"dp_size and tp_size must be >= 1, got {dp_size} and {tp_size}")
        if dp_size * tp_size > len(devices):
            raise ValueError(f"dp_size {dp_size} x tp_size {tp_size} needs {dp_size * tp_size} devices, "
                             f"{len(devices)} given ({devices[0].platform})")
        seed = cfg.seed if cfg.seed is not None else secrets.randbelow(2**31)
        replicas: list[Engine] = []
        tokens = None
        for i in range(dp_size):
            group = devices[i * tp_size:(i + 1) * tp_size]
            # a mesh even over one device: the replica's weights and pool are placed on it, not on
            # the default device that every replica would otherwise share
            mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=tp_size), group)
            model = load_model(mesh)
            mine = dataclasses.replace(cfg, seed=seed + i)
            if cfg.kv_cache == "paged":
                # sized once, on the first replica before any pool exists: a pool sized from the
                # first device's free memory after another replica's pool would come out smaller
                if tokens is None:
                    tokens = replica_pool_tokens(cfg, model, dp_size, group[0].platform)
                mine = dataclasses.replace(mine, max_total_tokens=tokens, mem_fraction_static=None)
            replicas.append(Engine(model, mine, eos_token_ids=eos_token_ids, mesh=mesh, version=version))
        return cls(replicas, seed=seed, tp_size=tp_size, max_total_tokens=cfg.max_total_tokens)

    # -- properties: the whole server's, summed or shared --

    @property
    def dp_size(self) -> int:
        return len(self.replicas)

    @property
    def cfg(self) -> EngineConfig:
        """One replica's configuration (the limits are per replica, as in SGLang)."""
        return self.replicas[0].cfg

    @property
    def model(self) -> Decoder:
        return self.replicas[0].model

    @property
    def mesh(self) -> Any:
        return self.replicas[0].mesh

    @property
    def eos_token_ids(self) -> set[int]:
        return self.replicas[0].eos_token_ids

    @property
    def version(self) -> int:
        """The oldest weights any replica serves (all equal outside a weight update)."""
        return min(r.version for r in self.replicas)

    # counts over every rank: the sum of each replica's own
    num_running = _total("num_running")
    num_waiting = _total("num_waiting")
    num_live = _total("num_live")
    num_free_slots = _total("num_free_slots")
    num_lanes = _total("num_lanes")

    @property
    def lane_slots(self) -> int:
        return self.replicas[0].lane_slots

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.replicas[0].max_seq_len

    @property
    def stats(self) -> dict[str, Any]:
        """Each counter summed over the replicas."""
        out: dict[str, Any] = {}
        for r in self.replicas:
            for k, v in r.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    @property
    def alive(self) -> bool:
        """Every replica can generate: a dead replica takes the server down (and a supervisor
        restarts it), as a dead SGLang scheduler does."""
        return all(r.alive for r in self.replicas)

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def paused(self) -> str | None:
        return next((r.paused for r in self.replicas if r.paused is not None), None)

    @property
    def state(self) -> Any:
        """The first replica's served state (``set_state`` places one like it on every replica)."""
        return self.replicas[0].state

    async def wait_dead(self) -> BaseException:
        """Return once any replica is dead, with what killed it."""
        waits = [asyncio.ensure_future(r.wait_dead()) for r in self.replicas]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for w in waits:
                w.cancel()

    # -- lifecycle --

    async def start(self) -> None:
        for r in self.replicas:
            await r.start()

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.replicas))

    def step_shapes(self) -> list[tuple[str, int, int, int]]:
        """Every replica's compiled-step shapes, one list (each replica compiles its own: its
        programs run on other devices)."""
        return [s for r in self.replicas for s in r.step_shapes()]

    def warmup(self, stop: threading.Event | None = None) -> int:
        """Each replica's ``warmup`` in turn; returns the shapes compiled in all."""
        done = 0
        for r in self.replicas:
            if stop is not None and stop.is_set():
                break
            done += r.warmup(stop)
        return done

    # -- requests --

    def _load(self, i: int) -> tuple[int, int]:
        r = self.replicas[i]
        allocator = getattr(r, "allocator", None)
        return r.num_live, -(allocator.free_pages if allocator is not None else r.num_free_slots)

    def route(self, input_ids: Sequence[int]) -> int:
        """The replica a new request with prompt ``input_ids`` goes to (see the module docstring)."""
        key = tuple(input_ids)
        homes = [i for i, h in enumerate(self._homes) if h[key]]
        for i in sorted(homes, key=self._load):
            if self.replicas[i].num_live < self.replicas[i].cfg.num_slots:
                return i
        return min(range(len(self.replicas)), key=lambda i: (*self._load(i), i))

    @contextlib.contextmanager
    def _routed(self, req: GenerateRequest) -> Any:
        if req.rid in self._where:
            raise DuplicateRequestError(f"rid {req.rid!r} is already waiting or running; give each request its own rid")
        i = self.route(req.input_ids)
        key = tuple(req.input_ids)
        self._where[req.rid] = i
        self._homes[i][key] += 1
        try:
            yield self.replicas[i]
        finally:
            del self._where[req.rid]
            self._homes[i][key] -= 1
            if not self._homes[i][key]:
                del self._homes[i][key]

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        """Run ``req`` to completion on the replica ``route`` picks."""
        with self._routed(req) as replica:
            return await replica.generate(req)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """``Engine.stream`` on the replica ``route`` picks."""
        with self._routed(req) as replica:
            gen = replica.stream(req)
            try:
                async for out in gen:
                    yield out
            finally:
                await gen.aclose()

    def replica_of(self, rid: str) -> int | None:
        """The replica running or holding request ``rid``; None if no such request is live."""
        return self._where.get(rid)

    async def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort one request (on its replica) or every request on every replica; returns how many."""
        if abort_all:
            counts = await asyncio.gather(*(r.abort(abort_all=True, message=message) for r in self.replicas))
            return sum(counts)
        i = self._where.get(rid) if rid is not None else None
        return 0 if i is None else await self.replicas[i].abort(rid, message=message)

    async def pause(self, mode: str = "abort") -> None:
        await asyncio.gather(*(r.pause(mode) for r in self.replicas))

    async def resume(self) -> None:
        await asyncio.gather(*(r.resume() for r in self.replicas))

    async def flush_cache(self) -> bool:
        """Flush every replica's cache; False if any refused (requests running there)."""
        return all(await asyncio.gather(*(r.flush_cache() for r in self.replicas)))

    def prompt_logprobs(self, input_ids: list[int], temperature: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``Engine.prompt_logprobs`` on the least loaded replica (all serve the same weights)."""
        i = min(range(len(self.replicas)), key=lambda i: (*self._load(i), i))
        return self.replicas[i].prompt_logprobs(input_ids, temperature)

    # -- weights --

    def stage_weights(self, *, hf_layout: bool = True) -> ReplicaStage:
        """A ``ReplicaStage``: the next weights staged on every replica as the parts arrive."""
        return ReplicaStage([r.stage_weights(hf_layout=hf_layout) for r in self.replicas])

    async def prepare_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                              stage: ReplicaStage | None = None) -> list[Any]:
        """Every replica's new state (``Engine.prepare_weights``), one per replica, for
        ``swap_weights``; raises (nothing served changes) if any replica's fails."""
        if stage is not None and not isinstance(stage, ReplicaStage):
            raise TypeError("a ReplicaEngine's weights are staged with its own stage_weights()")
        return list(await asyncio.gather(*(
            r.prepare_weights(tensors, model_dir=model_dir, stage=None if stage is None else stage.stages[i])
            for i, r in enumerate(self.replicas))))

    async def swap_weights(self, state: Sequence[Any], *, version: int) -> None:
        """Serve ``state`` (from ``prepare_weights``: one per replica) on every replica."""
        async with self._update_lock:
            await self._swap(state, version)

    async def _swap(self, states: Sequence[Any], version: int) -> None:
        if len(states) != len(self.replicas):
            raise ValueError(f"new weights for {len(states)} replicas; this server has {len(self.replicas)}")
        for r, s in zip(self.replicas, states, strict=True):  # all checked before any swaps
            check_swappable(r.state, s)
        await asyncio.gather(*(r.swap_weights(s, version=version) for r, s in zip(self.replicas, states, strict=True)))

    async def update_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                             stage: ReplicaStage | None = None, version: int) -> None:
        """``Engine.update_weights`` on every replica: all prepared first, then all swapped, so an
        invalid tensor changes nothing anywhere."""
        async with self._update_lock:
            states = await self.prepare_weights(tensors, model_dir=model_dir, stage=stage)
            await self._swap(states, version)

    async def set_state(self, state: Any, *, version: int) -> None:
        """Serve ``state`` (shaped like ``self.state``) on every replica, placed on each
        replica's devices (a copy where they differ from where ``state`` lives)."""
        placed = [_placed_like(state, r.state) for r in self.replicas]
        async with self._update_lock:
            for r, s in zip(self.replicas, placed, strict=True):
                check_swappable(r.state, s)
            await asyncio.gather(*(r.set_state(s, version=version) for r, s in zip(self.replicas, placed, strict=True)))

    # -- what /get_server_info reports --

    def server_info(self) -> dict[str, Any]:
        """SGLang's top-level scheduler info under dp: the first rank's (its pool, its running
        limit: every rank has its own), with ``dp_size`` and ``tp_size`` beside it."""
        return {**self.replicas[0].server_info(), "max_total_tokens": self._max_total_tokens,
                "dp_size": self.dp_size, "tp_size": self.tp_size}

    def replica_states(self) -> list[dict[str, Any]]:
        """One entry per replica (SGLang's ``internal_states`` holds one per dp rank)."""
        out = []
        for i, r in enumerate(self.replicas):
            allocator = getattr(r, "allocator", None)
            state = {"dp_rank": i, "num_running": r.num_running, "num_waiting": r.num_waiting,
                     "live_requests": r.num_live, "num_slots": r.lane_slots * r.num_lanes, "lanes": r.num_lanes,
                     "free_slots": r.num_free_slots, "engine_version": r.version,
                     "random_seed": r.seed, "placement": r.placement(),
                     "max_total_num_tokens": r.server_info()["max_total_num_tokens"]}
            if allocator is not None:
                state.update(free_pages=allocator.free_pages, token_usage=allocator.used_pages / allocator.num_pages)
            out.append(state)
        return out

    def placement(self) -> dict[str, Any]:
        """Every replica's ``Engine.placement``."""
        return {"replicas": [r.placement() for r in self.replicas]}


def _placed_like(state: Any, like: Any) -> Any:
    """``state``'s arrays on ``like``'s shardings, in ``like``'s tree (its variables' metadata,
    which records the mesh a model was made on); the parameters must match by path."""
    keystr = jax.tree_util.keystr
    state = split_layers(state, like=like)  # stacked layer parameters into the serving layout, placed
    given = jax.tree_util.tree_leaves_with_path(state)
    wanted = jax.tree_util.tree_leaves_with_path(like)
    if [keystr(p) for p, _ in given] != [keystr(p) for p, _ in wanted]:
        diff = sorted({keystr(p) for p, _ in given} ^ {keystr(p) for p, _ in wanted})
        raise ValueError(f"set_state: the given state and the served one differ in parameters {diff[:5]}")
    leaves = [jax.device_put(x, old.sharding) for (_, x), (_, old) in zip(given, wanted, strict=True)]
    return jax.tree.unflatten(jax.tree.structure(like), leaves)
