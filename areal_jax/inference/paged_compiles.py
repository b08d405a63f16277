"""Compiling a paged engine's step shapes in the background while it serves: after ``start()``
the shapes not compiled yet (``PagedShapes.step_shapes``, in the order the first requests need
them, ``PagedShapes.compile_order``) are compiled ahead of time in worker threads, several at once
(an XLA compile runs outside the GIL), and a step about to run a shape asks for it first
(``BackgroundCompiles.claim``): a shape a worker compiles now is waited for (a second compile of
it would only compete for the cores), one no worker has started is taken off the queue and
compiled by the step's own call, and one compiled already costs nothing. ``jit(f).lower(...)
.compile()`` fills the same in-process cache as a call of ``f``, so the step's call of a shape
compiled ahead finds it compiled.

Without it, an engine started without ``warmup`` (a server's ``--skip-server-warmup``, the
in-process engine of ``rollout.backend: local``) compiles each shape at its first call, one after
another, while every request waits: on a cold compilation cache a run's held-out evaluation
before RL spent nearly all its time compiling 7 of the 8 shapes in turn."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["BackgroundCompiles"]


class BackgroundCompiles:
    """Compile ``shapes`` (each by ``compile_one(shape)``) in ``threads`` daemon worker threads,
    in the order given. The workers are daemons so that a process that exits without ``close``
    does not wait for the compiles queued behind the ones in hand."""

    def __init__(self, shapes: Sequence[Any], compile_one: Callable[[Any], None], threads: int, *,
                 urgent: int | None = None, nice: int = 10):
        if threads < 1:
            raise ValueError(f"BackgroundCompiles: threads must be >= 1, got {threads}")
        self._compile_one = compile_one
        self._urgent = set(shapes[:len(shapes) if urgent is None else urgent])
        self._nice = nice
        self._lock = threading.Lock()
        self._queue: list[Any] = list(shapes)
        self.futures: dict[Any, Future] = {shape: Future() for shape in shapes}
        """Each shape's compile: done (its result the seconds it took, or its error), running in a
        worker, or cancelled (a step's own call compiled it: ``claim``)."""
        self.stats = {"ahead": 0, "claimed": 0, "waits": 0, "wait_seconds": 0.0, "failed": 0}
        """Shapes compiled by a worker, shapes a step compiled itself (taken off the queue),
        steps that waited for a worker's compile and the seconds they waited, failed compiles."""
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"engine-compile-{i}", daemon=True)
                         for i in range(min(threads, len(self._queue)))]
        for t in self._threads:
            t.start()

    def _next(self) -> tuple[Any, Future] | None:
        with self._lock:
            while self._queue and not self._stopping:
                shape = self._queue.pop(0)
                fut = self.futures[shape]
                if fut.set_running_or_notify_cancel():  # False: a step claimed it first
                    return shape, fut
            return None

    def _work(self) -> None:
        lowered = False
        while (item := self._next()) is not None:
            shape, fut = item
            if shape not in self._urgent and not lowered and self._nice > 0:
                lowered = True
                _lower_priority(self._nice)
            t0 = time.perf_counter()
            try:
                self._compile_one(shape)
            except BaseException as e:  # noqa: BLE001 - the step's own call raises it where it matters
                self.stats["failed"] += 1
                log.warning("compiling step shape %s in the background failed (its first call compiles it): %s: %s",
                            shape, type(e).__name__, e)
                fut.set_exception(e)
                continue
            self.stats["ahead"] += 1
            fut.set_result(time.perf_counter() - t0)

    def claim(self, shape: Any) -> None:
        """Called before a step runs ``shape``: returns once no worker compiles it. A shape no
        worker has started is taken off the queue (the step's call compiles it); one a worker
        compiles is waited for. Never raises for a failed compile: the step's call then compiles
        (and reports) it itself."""
        fut = self.futures.get(shape)
        if fut is None or fut.done():
            return
        if fut.cancel():
            self.stats["claimed"] += 1
            return
        t0 = time.perf_counter()
        self.stats["waits"] += 1
        try:
            fut.exception()  # waits; the step's own call reports a failure
        finally:
            self.stats["wait_seconds"] += time.perf_counter() - t0

    def compiled(self, shape: Any) -> bool:
        """Whether a worker compiled ``shape`` (a call of it compiles nothing)."""
        fut = self.futures.get(shape)
        return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None

    def running(self, shape: Any) -> bool:
        """Whether a worker compiles ``shape`` now."""
        fut = self.futures.get(shape)
        return fut is not None and fut.running()

    @property
    def pending(self) -> list[Any]:
        """Shapes not compiled yet by a worker nor claimed by a step (queued or in hand)."""
        return [s for s, f in self.futures.items() if not f.done()]

    def close(self, wait: bool = True) -> None:
        """Start no more compiles; with ``wait``, return once the ones in hand have ended (a
        compile cannot be interrupted)."""
        with self._lock:
            self._stopping = True
            for shape in self._queue:
                self.futures[shape].cancel()
            self._queue.clear()
        if wait:
            for t in self._threads:
                t.join()


def _lower_priority(nice: int) -> None:
    """Raise this thread's niceness by ``nice`` (Linux: a thread is a task of its own), so that the
    compiles no step waits for take the cores the serving and the trainer leave idle. It cannot be
    lowered back without privileges: a worker stays at it."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: the compiles run as they are
        log.debug("could not lower a compile thread's priority: %s", e)
