"""How long a block of code spent in JAX's compiler: tracing, lowering and XLA compilation
(a persistent-cache load counts as compilation), in the calling thread only.

``Trainer.train_batch`` reports it as ``compile_seconds``: a train step that meets a new shape
(a length bucket or an attention pair budget seen for the first time) spends seconds compiling
where a warm step spends a fraction of one, and a benchmark that times steps has to be able to
tell the two apart. JAX reports each phase as a time span; nested spans (a jitted function
traced inside another) are merged, so no second is counted twice.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jax.monitoring

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
"""JAX's span events for the three phases of turning a Python function into an executable."""

_local = threading.local()
_register_lock = threading.Lock()
_registered = False


@dataclass
class CompileTime:
    """Filled in when the ``compile_clock`` block ends."""

    seconds: float = 0.0
    """Wall-clock seconds the block's thread spent compiling (overlapping spans merged)."""
    spans: list[tuple[float, float]] = field(default_factory=list)


def _on_span(event: str, start: float, end: float, **_: Any) -> None:
    spans = getattr(_local, "spans", None)
    if spans is not None and event in COMPILE_EVENTS:
        spans.append((start, end))


def _ensure_listener() -> None:
    global _registered
    with _register_lock:
        if not _registered:
            jax.monitoring.register_event_time_span_listener(_on_span)
            _registered = True


def merged_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@contextlib.contextmanager
def compile_clock() -> Iterator[CompileTime]:
    """Time this thread's compilation inside the block. Blocks nest: an outer block also counts
    what an inner one saw."""
    _ensure_listener()
    outer = getattr(_local, "spans", None)
    _local.spans = result_spans = []
    result = CompileTime(spans=result_spans)
    try:
        yield result
    finally:
        _local.spans = outer
        if outer is not None:
            outer.extend(result_spans)
        result.seconds = merged_seconds(result_spans)
