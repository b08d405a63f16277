"""The timeline of a run's start: where the seconds before (and in) step 1 go.

A run's start is several things at once: the rollout servers start in their own processes
(import, model load, first compiles) while this process loads the model, builds the trainer and
compiles; then the first batch is generated, the first update compiles and runs, and the first
weight push goes out. ``StartupTimeline`` records each as a named span, in seconds from the
run's start, so that the run's log says which of them step 1 waited for (``describe``) and
step 1's metrics carry them (``startup``). Spans may overlap: that is the point of most of them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from rollout_bridge.launcher import process_age

__all__ = ["StartupTimeline", "compile_cache_env", "process_age", "use_compile_cache"]


class StartupTimeline:
    """Named ``(start, end)`` spans, seconds from ``t0`` (a ``time.perf_counter()`` reading).
    Safe to add to from several threads (the servers start in one)."""

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = time.perf_counter() if t0 is None else t0
        self.spans: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def add(self, name: str, start: float, end: float | None = None) -> None:
        """Record span ``name`` from ``start`` to ``end`` (``perf_counter`` readings; end: now)."""
        end = time.perf_counter() if end is None else end
        with self._lock:
            self.spans[name] = (start - self.t0, end - self.t0)

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record the block as span ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start)

    def add_servers(self, accounts: list[dict[str, float | None] | None],
                    started: str = "rollout servers started (process, imports, model load, /health)") -> None:
        """The servers' own accounts of their start (``servers_startup``), placed from the start
        of span ``started`` (when they were launched): server ``i``'s interpreter and imports, then
        its model load and engine build."""
        with self._lock:
            if started not in self.spans:
                return
            launched = self.spans[started][0] + self.t0
        for i, account in enumerate(accounts):
            if not account or account.get("imports_seconds") is None:
                continue
            imported = launched + float(account["imports_seconds"])
            self.add(f"server {i}: interpreter and imports", launched, imported)
            self.add(f"server {i}: model loaded, engine built", imported,
                     imported + float(account.get("model_and_engine_seconds") or 0.0))

    def as_dict(self) -> dict[str, list[float]]:
        """``{name: [start, end]}`` in seconds from the run's start, in order of start."""
        with self._lock:
            items = sorted(self.spans.items(), key=lambda kv: kv[1])
        return {name: [round(a, 3), round(b, 3)] for name, (a, b) in items}

    def describe(self) -> str:
        """One line per span: when it started and ended, and how long it took."""
        lines = ["start-up (seconds from the run's start; spans overlap where work runs in parallel):"]
        for name, (a, b) in self.as_dict().items():
            lines.append(f"  {a:6.1f} -> {b:6.1f}  ({b - a:5.1f}s)  {name}")
        return "\n".join(lines)


CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                  "jax_persistent_cache_min_entry_size_bytes")
"""JAX's persistent-cache settings that child processes get through their environment."""


def use_compile_cache(directory: str | None, *, override: bool = False) -> str | None:
    """Turn on JAX's persistent compilation cache in ``directory`` (``~`` expanded) for this
    process, unless one is set already (``JAX_COMPILATION_CACHE_DIR``, or ``jax.config`` in a
    notebook), which wins with its own thresholds; ``override``: ``directory`` wins (the bench's
    own cache), and child processes started later inherit it through the environment. Ours keeps
    every program, however quick its compile: a small model's start is hundreds of small compiles
    (building a tiny model, whose random init compiles op by op, took 7.7 s with an empty cache
    and 2.0 s from it on a loaded 2-core CPU; JAX's default keeps only compiles over 1 s).
    Returns the cache directory in use, or None."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if not directory or (current and not override):
        return current or None
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if override:
        os.environ.update(compile_cache_env())
    return path


def compile_cache_env() -> dict[str, str]:
    """The environment that gives a child process this process's persistent compilation cache
    (directory and thresholds, as ``jax.config`` holds them now; empty without a cache): a
    rollout server then loads what the runs before it compiled, and stores what it compiles."""
    import jax

    if not jax.config.jax_compilation_cache_dir:
        return {}
    return {name.upper(): str(getattr(jax.config, name)) for name in CACHE_SETTINGS}
