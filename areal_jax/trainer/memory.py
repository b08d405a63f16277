"""The train step's memory plan: per-device bytes from XLA's own analysis of the compiled steps,
the device's capacity, and the remat policy that fits.

Before the first step the trainer lowers its gradient step at the largest micro-batch it will
meet and its optimizer step, on abstract arguments (``jax.ShapeDtypeStruct``: nothing is
allocated), compiles them and reads ``compiled.memory_analysis()``. A step's peak on one device
is what stays resident between steps and is not among its arguments (the optimizer state during
the gradient step; a reference model; a critic), plus its arguments and outputs (less the donated
buffers its outputs reuse), plus XLA's scratch (``temp``: activations kept for the backward
pass, gathered weights, logits chunks).

With ``train.remat='auto'`` (the default) the plan tries ``none``, ``dots`` and ``full`` in that
order (least recompute first) and keeps the first that fits; a policy given by name is checked
and kept. When nothing fits, the error names the knobs. With no capacity known (a CPU without
``train.device_memory_gb``) nothing is compiled and ``auto`` means ``none``.

An in-process engine on the trainer's own devices (``rollout.backend: local``, placement
``shared``) sits beside the step for the whole run: its KV cache and its copy of the weights
(``EngineMemory``) are added to every policy's peak, both counted at the engine's own sharding
(its mesh, its tensor split): on several processes each host's engine is sharded over that
host's devices only, so a device holds a larger share of the engine's weights than of the
trainer's, whose mesh spans every host. The paged engine's pool is
``--max-total-tokens`` tokens, or, sized from memory, what ``--mem-fraction-static`` of the device
leaves after what is already on it (the trainer's state, the engine's weights): the engine is
built after the trainer, so that share is taken from the room the step's scratch needs.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from sharding import activate

log = logging.getLogger(__name__)

GiB = 2**30
REMAT_ORDER = ("none", "dots", "full")
"""Remat policies from the least recompute (and most memory) to the most."""
DEVICE_HEADROOM = 0.9
"""Share of a device's reported memory limit the plan may fill: the rest is left to what XLA's
analysis does not see (allocator fragmentation, collective and cuDNN scratch, the placed
training batch, an in-flight weight push). An explicit ``train.device_memory_gb`` is used whole."""


class MemoryPlanError(ValueError):
    """The train step does not fit the device under any allowed remat policy."""


@dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one remat policy's train step (XLA's figures, see the module docstring)."""

    remat: str
    state_bytes: int
    """Resident between steps: params, optimizer state, and any reference model or critic."""
    grad_peak_bytes: int
    """Peak while a micro-batch's gradient is computed and accumulated."""
    grad_temp_bytes: int
    """XLA's scratch of that gradient step (activations, gathered weights, logits chunks)."""
    apply_peak_bytes: int
    """Peak during the optimizer step."""

    @property
    def peak_bytes(self) -> int:
        return max(self.grad_peak_bytes, self.apply_peak_bytes)

    def describe(self) -> str:
        return (f"remat={self.remat}: {self.peak_bytes / GiB:.1f} GiB per device at peak "
                f"({self.state_bytes / GiB:.1f} GiB params and optimizer state, "
                f"{self.grad_temp_bytes / GiB:.1f} GiB gradient-step scratch)")


@dataclass(frozen=True)
class MemoryPlan:
    """What the plan chose, and why."""

    remat: str
    capacity_bytes: int
    capacity_source: str
    """Where the capacity came from (``train.device_memory_gb``, or the device's own limit)."""
    chosen: StepMemory
    tried: tuple[StepMemory, ...]
    """Every policy compiled, in order, the chosen one last."""
    engine: EngineMemory | None = None
    """An in-process engine on the same devices, counted beside the step."""

    @property
    def engine_bytes(self) -> int:
        return 0 if self.engine is None else self.engine.bytes_beside(self.chosen.state_bytes)

    def describe(self) -> str:
        skipped = "".join(f"; {m.remat} needs {m.peak_bytes / GiB:.1f} GiB" for m in self.tried[:-1])
        engine = "" if self.engine is None else f", {self.engine.describe(self.chosen.state_bytes)}"
        return (f"memory plan: {self.chosen.describe()}{engine}, within {self.capacity_bytes / GiB:.1f} GiB "
                f"({self.capacity_source}){skipped}")

    def metrics(self) -> dict[str, Any]:
        """Added to every train step's statistics."""
        out = {"remat": self.remat, "memory_peak_gib": self.chosen.peak_bytes / GiB,
               "memory_capacity_gib": self.capacity_bytes / GiB}
        if self.engine is not None:
            out["memory_engine_gib"] = self.engine_bytes / GiB
        return out


@dataclass(frozen=True)
class EngineMemory:
    """Per-device bytes of an in-process engine on the trainer's devices (``engine_memory``)."""

    kv_cache: str
    """``slots`` or ``paged``."""
    token_bytes: int
    """One token's keys and values in every layer, of the heads one device holds."""
    tokens: int
    """Tokens of KV cache one device holds: slots x context over the data-parallel ways, or the
    pool's ``--max-total-tokens``; with ``fraction``, the most the pool may hold."""
    weight_bytes: int
    """The engine's weights on one device, at the engine's own sharding (``engine_weight_bytes``),
    counted beside every peak. A ``--dtype`` other than the trainer's float32 is a cast copy,
    always there. A float32 engine on the trainer's mesh serves the trainer's own arrays, lent
    (``Learner.lend``): the optimizer step cannot write over them, so the new params are a
    second copy at its peak (exact there; at the gradient step, where the engine and the trainer
    hold the same arrays, an over-count by one copy)."""
    fraction: float | None = None
    """Paged, sized from memory: weights and pool take this share of ``device_bytes``."""
    device_bytes: int | None = None

    def cache_bytes(self, beside: int) -> int:
        """The KV cache's bytes on one device, with ``beside`` bytes (the trainer's state) there first."""
        if self.fraction is None or self.device_bytes is None:
            return self.tokens * self.token_bytes
        room = int(self.fraction * self.device_bytes) - beside - self.weight_bytes
        return min(self.tokens, max(room, 0) // self.token_bytes) * self.token_bytes

    def bytes_beside(self, beside: int) -> int:
        """Everything the engine holds on one device, with ``beside`` bytes there first."""
        return self.cache_bytes(beside) + self.weight_bytes

    def describe(self, beside: int) -> str:
        cache = self.cache_bytes(beside)
        sized = f"--mem-fraction-static {self.fraction:g}" if self.fraction else "--max-total-tokens"
        what = "slot cache" if self.kv_cache == "slots" else f"page pool ({sized})"
        return (f"engine beside it: {cache / GiB:.1f} GiB {what}, {cache // max(self.token_bytes, 1):,} tokens, "
                f"and {self.weight_bytes / GiB:.1f} GiB of weights")

    @property
    def knobs(self) -> str:
        """The engine's flags that move its share (``rollout.server_args``)."""
        if self.kv_cache == "slots":
            return "rollout.server_args --max-running-requests or --context-length (the slot cache)"
        return "rollout.server_args --max-total-tokens or --mem-fraction-static (the page pool)"


def engine_memory(model: Any, engine: Any, mesh: Any, *, dtype: Any = None, device_limit: int | None = None,
                  fused: bool = False) -> EngineMemory:
    """What an engine of ``EngineConfig`` ``engine`` serving ``model`` (a ``ModelConfig``, or a
    model) takes on each device of ``mesh``, the engine's own (the trainer's, which a shared
    engine runs on in one process; a host's devices on several): slots split over data x fsdp,
    KV heads over tensor (replicated where it is wider than their count, ``kv_head_replicas``),
    its weights as that mesh shards them (``engine_weight_bytes``; ``fused``: q/k/v and gate/up
    fused, as a pod's engines load them). ``dtype``: the engine's ``--dtype`` (default the
    checkpoint's); ``device_limit``: the device's size in bytes, which ``--mem-fraction-static``
    is a share of (the paged pool is sized from it when no ``--max-total-tokens`` alone is
    given; without it the fraction cannot be planned)."""
    cfg = getattr(model, "config", model)
    weight_bytes = engine_weight_bytes(cfg, mesh, dtype, fused=fused)
    tensor = int(mesh.shape.get("tensor", 1))
    ways = int(mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1))
    heads = max(-(-cfg.num_key_value_heads // tensor), 1)
    cache_dtype = np.dtype(engine.cache_dtype or dtype or cfg.jnp_dtype)
    token_bytes = 2 * cfg.num_hidden_layers * heads * cfg.head_dim * cache_dtype.itemsize
    most = -(-engine.num_slots * engine.max_seq_len // ways)
    if engine.kv_cache == "slots":
        return EngineMemory("slots", token_bytes, most, weight_bytes)
    if engine.max_total_tokens is not None:
        most = min(most, engine.max_total_tokens)
        if engine.mem_fraction_static is None:
            return EngineMemory("paged", token_bytes, most, weight_bytes)
    from areal_jax.inference.pool_size import DEFAULT_DEVICE_FRACTION

    if device_limit is None:  # a CPU: the engine sizes from host memory, not from the device
        return EngineMemory("paged", token_bytes, 0, weight_bytes)
    return EngineMemory("paged", token_bytes, most, weight_bytes,
                        engine.mem_fraction_static or DEFAULT_DEVICE_FRACTION, device_limit)


def engine_weight_bytes(cfg: Any, mesh: Any, dtype: Any = None, *, fused: bool = False) -> int:
    """Bytes of an engine's weights (``cfg``: a ``ModelConfig``) on the device of ``mesh`` that
    holds the most, in ``dtype`` (default the checkpoint's), sharded as the engine loads them
    there: the model built abstractly on ``mesh`` (``nnx.eval_shape``: nothing allocated) under
    the default logical rules, ``fused`` or not (a fused q/k/v kernel is laid out for the
    tensor split, so where that is wider than the KV heads it holds fewer copies of them)."""
    import dataclasses

    from flax import nnx

    from areal_jax.models import Decoder

    if cfg.fuse_projections != fused:
        cfg = dataclasses.replace(cfg, fuse_projections=fused)
    with activate(mesh):
        model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    itemsize = np.dtype(dtype if dtype is not None else cfg.param_dtype).itemsize
    return sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param))) \
        * itemsize


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of ``tree``'s arrays (or ``ShapeDtypeStruct`` leaves with shardings):
    each leaf's shard on the device that holds the most of it."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def abstract(tree: Any) -> Any:
    """``tree`` as ``jax.ShapeDtypeStruct`` leaves with the same shardings."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


def _device_stats(devices: Sequence[jax.Device]) -> list[tuple[int, int]] | None:
    """Each device's (``bytes_limit``, ``bytes_in_use``), or None when any reports no limit (CPU)."""
    out = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if not stats or not stats.get("bytes_limit"):
            return None
        out.append((int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))))
    return out or None


def device_capacity(memory_gb: float | None, devices: Sequence[jax.Device]) -> tuple[int | None, str]:
    """Bytes per device the train step may plan for, and where the figure came from: ``memory_gb``
    (``train.device_memory_gb``) when set, else ``DEVICE_HEADROOM`` of the smallest limit the
    devices report (``memory_stats()['bytes_limit']``: GPU, TPU) less the most any of them has
    in use already (the loaded model, an engine's page pool), else None (CPU)."""
    if memory_gb is not None:
        return int(memory_gb * GiB), f"train.device_memory_gb={memory_gb:g}"
    stats = _device_stats(devices)
    if stats is None:
        return None, "no device memory limit known"
    limit, used = min(s[0] for s in stats), max(s[1] for s in stats)
    source = f"{DEVICE_HEADROOM:.0%} of the {limit / GiB:.1f} GiB the device reports"
    if used:
        source += f", less {used / GiB:.1f} GiB already in use"
    return int(limit * DEVICE_HEADROOM) - used, source


def device_limit(memory_gb: float | None, devices: Sequence[jax.Device]) -> int | None:
    """A device's whole size in bytes: ``train.device_memory_gb`` when set, else the smallest limit
    the devices report, else None (CPU)."""
    if memory_gb is not None:
        return int(memory_gb * GiB)
    stats = _device_stats(devices)
    return None if stats is None else min(s[0] for s in stats)


def step_memory(learner: Any, batch: dict[str, jax.ShapeDtypeStruct], scalars: dict[str, Any],
                resident_bytes: int = 0, apply_live: int | None = None) -> StepMemory:
    """Compile ``learner``'s gradient step on ``batch`` (and, unless ``apply_live`` gives its own
    peak from an earlier call, its optimizer step, which remat does not change) and read their
    memory. ``resident_bytes``: what else stays on the device (reference model, critic)."""
    params, opt_state = abstract(learner.params), abstract(learner.opt_state)
    rep = learner.replicated
    scalars = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=rep) for k, v in scalars.items()}
    opt_bytes = device_bytes(opt_state)
    with activate(learner.mesh, learner.rules):
        grad = learner.grad_fn.lower(params, params, batch, scalars).compile().memory_analysis()
        if apply_live is None:
            step = jax.ShapeDtypeStruct((), np.int32, sharding=rep)
            apply_live = _live(learner.apply_fn.lower(params, opt_state, params, step).compile().memory_analysis())
    return StepMemory(
        remat=learner.remat,
        state_bytes=device_bytes(params) + opt_bytes + resident_bytes,
        grad_peak_bytes=_live(grad) + opt_bytes + resident_bytes,
        grad_temp_bytes=int(grad.temp_size_in_bytes),
        apply_peak_bytes=apply_live + resident_bytes,
    )


def _live(analysis: Any) -> int:
    """A compiled step's own peak: arguments, outputs not written over donated arguments, scratch."""
    return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
               - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)


def plan_remat(learner: Any, batch: dict[str, jax.ShapeDtypeStruct], scalars: dict[str, Any], *,
               capacity: int, capacity_source: str, policies: Sequence[str] = REMAT_ORDER,
               resident_bytes: int = 0, knobs: Callable[[], str] = lambda: "",
               engine: EngineMemory | None = None) -> MemoryPlan:
    """The first of ``policies`` whose step, with ``engine`` beside it (an in-process engine on the
    same devices), fits ``capacity`` bytes per device; ``learner`` is left on it (``use_remat``).
    Raises ``MemoryPlanError`` naming the knobs (``knobs()`` describes the run's current settings)
    when none fits."""
    tried: list[StepMemory] = []
    apply_live = None

    def beside(m: StepMemory) -> int:
        return 0 if engine is None else engine.bytes_beside(m.state_bytes)

    for policy in policies:
        learner.use_remat(policy)
        m = step_memory(learner, batch, scalars, resident_bytes, apply_live)
        apply_live = m.apply_peak_bytes - resident_bytes
        tried.append(m)
        if m.peak_bytes + beside(m) <= capacity:
            plan = MemoryPlan(policy, capacity, capacity_source, m, tuple(tried), engine)
            log.info("%s", plan.describe())
            return plan
    least = min(tried, key=lambda m: m.peak_bytes + beside(m))
    state = least.state_bytes
    hint = (f"params and optimizer state alone take {state / GiB:.1f} GiB per device: shard them over more "
            f"devices (raise mesh.fsdp)" if state > capacity else
            "lower train.micro_batch_tokens (activations grow with it), raise mesh.fsdp (params and optimizer "
            "state per device shrink with it)" + ("" if "full" in policies else ", allow more remat (train.remat: "
                                                  "full or auto)"))
    if engine is not None:
        hint += (f"; the engine beside the trainer takes {beside(least) / GiB:.1f} GiB "
                 f"({engine.describe(least.state_bytes)}): shrink it with {engine.knobs}, or give it devices of "
                 f"its own (rollout.local.placement: split)")
    raise MemoryPlanError(
        f"the train step does not fit the device: {'; '.join(m.describe() for m in tried)}; "
        f"{capacity / GiB:.1f} GiB available ({capacity_source}). {hint}; or set train.device_memory_gb if the "
        f"device has more memory than that{knobs()}")


_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo_text: str, op: str = "all-gather") -> dict[str, int]:
    """Bytes the ``op`` instructions of an HLO module's text produce, summed by element type
    (``{"bf16": ..., "f32": ...}``): each instruction once, as written (one inside a loop body
    counts once however often the loop runs). Reads the synchronous form and the ``-start``
    half of the asynchronous one, whose result tuple holds the operands too (counted as well,
    as the shard they are)."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = re.search(rf"=\s*(.*?)\s+{re.escape(op)}(?:-start)?\(", line)
        if not m:
            continue
        for dtype, dims in _SHAPE.findall(m.group(1)):
            if dtype in _DTYPE_BYTES:
                size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
                out[dtype] = out.get(dtype, 0) + size * _DTYPE_BYTES[dtype]
    return out
