"""The reward pool: reward functions run in worker processes, never in the trainer's process,
each call bounded by a timeout, awaited by async callers so generation never waits on a reward.

A call that times out, raises, or whose worker dies (``os._exit``, a signal, a memory limit)
scores 0, is counted and logged with its row id, and the worker is replaced (pebble's
``ProcessPool`` does the replacing and the per-call kill). Workers are forked from a
``forkserver``, a fresh interpreter that has imported the reward's libraries once: a fork of the
trainer's process (JAX threads) would be unsafe, and the workers share none of its memory. Each
worker caps its own address space (``memory_mb``). As with any Python process pool, a script
that starts a run must keep its top-level code under ``if __name__ == "__main__":``; a pool
whose workers cannot start at all raises ``RewardPoolBroken`` from every call instead of scoring
0, and the controller stops the run with it (every reward would be 0: no signal to learn from).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import resource
import signal
import threading
import time
from collections import Counter
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class RewardConfig:
    """The ``reward:`` section: which function scores answers, and the pool that runs it."""

    name: str = "reasoning_gym"
    """``math``, ``reasoning_gym``, ``code``, or a user's function by import path (``my_pkg.rewards:score``)."""
    num_workers: int = 2
    """Worker processes."""
    timeout_s: float = 15.0
    """Per call; past it the worker is killed and replaced and the answer scores 0."""
    memory_mb: int = 4096
    """Address-space limit of each worker process (RLIMIT_AS)."""
    code_all_or_nothing: bool = False
    """``code``: reward 1 only when every test passes, instead of the fraction passed."""
    code_timeout_s: float = 5.0
    """``code``: wall-clock limit of one sandboxed run."""
    code_memory_mb: int = 512
    """``code``: address-space limit of each sandboxed process."""
    code_max_processes: int = 16
    """``code``: processes and threads one sandboxed answer may have at once (its harness counts);
    its memory is at most this times ``code_memory_mb``, plus 64 MiB of files."""
    code_row_timeout_s: float = 60.0
    """``code``: most wall-clock time for all of one answer's tests (each gets ``code_timeout_s``);
    the pool's limit for a code call grows to fit it."""
    code_trust_inside_checks: bool = False
    """``code``: run assert tests that would be judged inside the solution's process (an assertion
    that cannot be split, such as ``assert f(1) == 2 or g()``, a test's own reference function, a
    ``raise``) there, where a hostile solution can forge their pass, instead of failing them
    (see BUILD.md, "Code rewards")."""
    unsandboxed: bool = False
    """``code``: where no OS-level isolation works (bubblewrap, see BUILD.md), run model-written code
    without it instead of refusing to start (logged loudly). Never on hardware you share."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.code_timeout_s <= 0 or self.code_row_timeout_s <= 0:
            raise ValueError("reward.code_timeout_s and reward.code_row_timeout_s must be > 0, got "
                             f"{self.code_timeout_s} and {self.code_row_timeout_s}")

    def fn_kwargs(self) -> dict[str, Any]:
        if self.name == "code":
            return {"all_or_nothing": self.code_all_or_nothing, "timeout_s": self.code_timeout_s,
                    "memory_mb": self.code_memory_mb, "max_processes": self.code_max_processes,
                    "row_timeout_s": self.code_row_timeout_s, "trust_inside_checks": self.code_trust_inside_checks,
                    "unsandboxed": self.unsandboxed}
        return {}

    def call_timeout(self, fields: dict[str, Any]) -> float:
        """The pool's limit for one call: ``timeout_s``, or for ``code`` at least the row's sandbox
        budget (its tests' time, sandbox starts, slack), so the sandbox times out before the worker."""
        if self.name != "code":
            return self.timeout_s
        from areal_jax.rewards.sandbox import STARTUP_S

        tests = fields.get("tests")
        n = len(tests) if isinstance(tests, list) else 1
        return max(self.timeout_s, 2 * STARTUP_S + min(self.code_timeout_s * n, self.code_row_timeout_s) + 5.0)

    def preflight(self) -> str | None:
        """For ``code``: the line that says which isolation the sandbox gets (for the run's first
        log lines); raises ``SandboxUnavailable`` when there is none and ``unsandboxed`` is false."""
        if self.name != "code":
            return None
        from areal_jax.rewards import isolation

        isolation.require(self.unsandboxed)
        line = isolation.describe(self.unsandboxed)
        if isolation.detect().kind == "none":
            log.warning("!" * 100 + "\n%s\n" + "!" * 100, line)
        else:
            log.info("%s", line)
        return line


@dataclass
class RewardResult:
    reward: float
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call scored 0 without an answer from the function (timeout, exception, dead worker)."""
    seconds: float = 0.0


_PRELOAD = {"math": ("math_verify",), "reasoning_gym": ("reasoning_gym",)}
"""Libraries the fork server imports once, so each worker starts warm."""


def _init_worker(memory_mb: int) -> None:
    limit = memory_mb * 1024 * 1024
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard if hard != resource.RLIM_INFINITY and hard < limit else limit))


def _call(name: str, prompt: str, completion: str, fields: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    from areal_jax.rewards import get_reward_fn

    return get_reward_fn(name)(prompt, completion, **fields, **kwargs)


def normalise(out: Any) -> tuple[float, dict[str, Any]]:
    """A reward function's return value as ``(float, dict)``; anything else is an error."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        value, extra = out
    else:
        value, extra = out, {}
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a reward function must return a float or (float, dict), got {out!r}")
    return float(value), extra


BROKEN_POOL = (
    "its worker processes could not start ({error}). Workers start from a forkserver that imports the main "
    "module: a script that builds the pool (or calls areal_jax.train) must keep its code under "
    "`if __name__ == \"__main__\":` (the usual cause; a worker's traceback above shows it).")
"""The message of ``RewardPoolBroken`` (logged once as an error)."""


class RewardPoolBroken(RuntimeError):
    """The pool cannot score: its workers cannot start, or it stopped working more than
    ``MAX_RESTARTS`` times. Raised by every call instead of a 0, since a run that went on would
    train on rewards that say nothing (the controller stops the run with it)."""


class _PoolStopped(Exception):
    """pebble's pool stopped working under a call (one of its threads died)."""


MAX_RESTARTS = 3
"""Replacements of a pool that stopped working, per ``RewardPool``, before it counts as broken."""

WATCH_S = 1.0
"""How often a call in flight checks that pebble's pool still works."""


def _works(pool: Any) -> bool:
    """Whether pebble's ``pool`` still takes and runs calls (asking may itself raise once its
    state went bad)."""
    try:
        return bool(pool.active)
    except Exception:
        return False


def _forget_broken_children() -> None:
    """Kill and forget the child processes whose handle went bad. ``multiprocessing`` polls every
    child it started each time it starts another, so one such child would make the new pool's
    workers fail to start too."""
    import multiprocessing.process as mp_process

    for child in list(mp_process._children):
        try:
            child._popen.poll()
        except Exception:
            mp_process._children.discard(child)
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGKILL)


def _stop_quietly(pool: Any) -> None:
    """Stop a pebble pool and its workers; a pool that stopped working may fail to, harmlessly."""
    with contextlib.suppress(Exception):
        pool.stop()
        pool.join(timeout=10)


class RewardPool:
    """``await pool.score(prompt, completion, fields, row_id=...)`` -> ``RewardResult``.

    pebble's pool runs on three threads in this process. If one dies (in one CI run the thread
    that polls the workers raised on a worker's handle), the pool refuses new calls and the
    calls in flight never finish, and a run would wait for them forever. A call therefore checks
    every ``WATCH_S`` that the pool still works; if not, the pool is replaced by a new one and
    the call runs again there (``stats["pool_restarts"]``), up to ``MAX_RESTARTS`` times."""

    def __init__(self, cfg: RewardConfig | None = None):
        from areal_jax.rewards import get_reward_fn

        self.cfg = cfg or RewardConfig()
        get_reward_fn(self.cfg.name)  # an unknown name fails here, before any work starts
        self.isolation = self.cfg.preflight()
        """The code sandbox's isolation, in words (``None`` for other rewards)."""
        self._pool = self._new_pool()
        self.stats: Counter = Counter()
        self._broken: str | None = None
        """``RewardPoolBroken``'s message once the pool is broken (pebble's pool refuses every
        later call with a bare ``RuntimeError``)."""
        self._closed = False

    def _new_pool(self) -> Any:
        from pebble import ProcessPool

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["areal_jax.rewards.builtin", *_PRELOAD.get(self.cfg.name, ())])
        return ProcessPool(max_workers=self.cfg.num_workers, initializer=_init_worker,
                           initargs=(self.cfg.memory_mb,), context=ctx)

    async def score(self, prompt: str, completion: str, reward_fields: dict[str, Any] | None = None, *,
                    row_id: str = "") -> RewardResult:
        from pebble import ProcessExpired

        t0 = time.perf_counter()
        self.stats["calls"] += 1
        args = (self.cfg.name, prompt, completion, dict(reward_fields or {}), self.cfg.fn_kwargs())
        timeout = self.cfg.call_timeout(args[3])
        while True:
            if self._closed:
                return self._failed("errors", "the reward pool was closed", row_id, t0)
            if self._broken is not None:
                self.stats["pool_broken"] += 1
                raise RewardPoolBroken(self._broken)
            pool = self._pool
            try:
                future = pool.schedule(_call, args=args, timeout=timeout)
                value, extra = normalise(await self._result(pool, future))
            except _PoolStopped as e:
                self._restart(pool, str(e))
                continue
            except BrokenProcessPool as e:  # before RuntimeError, its base class
                self._mark_broken(BROKEN_POOL.format(error=e))
                continue  # raises at the top of the loop
            except (TimeoutError, concurrent.futures.TimeoutError):
                return self._failed("timeouts", f"timed out after {timeout}s", row_id, t0)
            except ProcessExpired as e:
                return self._failed("worker_died", f"worker died (exit code {e.exitcode})", row_id, t0)
            except MemoryError:
                return self._failed("memory", f"ran out of memory (limit {self.cfg.memory_mb} MiB)", row_id, t0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not _works(pool):  # pebble's pool failed under the call, or refuses work: not the reward's fault
                    self._restart(pool, f"{type(e).__name__}: {e}")
                    continue
                return self._failed("errors", f"{type(e).__name__}: {e}", row_id, t0)
            self.stats["ok"] += 1
            return RewardResult(value, extra, None, time.perf_counter() - t0)

    @staticmethod
    async def _result(pool: Any, future: Any) -> Any:
        """The call's result, checking every ``WATCH_S`` that ``pool`` still works."""
        wrapped = asyncio.wrap_future(future)
        try:
            while True:
                done, _ = await asyncio.wait({wrapped}, timeout=WATCH_S)
                if done:
                    return wrapped.result()
                if not _works(pool):
                    raise _PoolStopped("pebble's pool stopped working (one of its threads died)")
        except BaseException:
            future.cancel()
            raise

    def _restart(self, pool: Any, reason: str) -> None:
        """Replace ``pool`` (if no other call did yet) by a new one, or mark the pool broken: when
        it never scored (its workers cannot start) or after ``MAX_RESTARTS`` replacements."""
        if pool is not self._pool or self._broken is not None or self._closed:
            return
        reason = " ".join(reason.split())[:300]  # one line (multiprocessing's errors run to paragraphs)
        if not self.stats["ok"]:  # it never scored: its workers cannot start, and a new pool would fail alike
            self._mark_broken(BROKEN_POOL.format(error=reason))
            return
        self.stats["pool_restarts"] += 1
        if self.stats["pool_restarts"] > MAX_RESTARTS:
            self._mark_broken(f"pebble's pool stopped working {MAX_RESTARTS + 1} times ({reason}); "
                              "see the errors above")
            return
        log.error("reward pool %s stopped working (%s): starting a new one (restart %d of at most %d); the "
                  "calls in flight run again", self.cfg.name, reason, self.stats["pool_restarts"], MAX_RESTARTS)
        _forget_broken_children()
        self._pool = self._new_pool()
        threading.Thread(target=_stop_quietly, args=(pool,), daemon=True).start()

    def _mark_broken(self, message: str) -> None:
        """From now on every call raises ``RewardPoolBroken`` with ``message`` (logged once)."""
        if self._broken is None:
            self._broken = f"reward pool {self.cfg.name!r}: {message}"
            log.error("%s", self._broken)

    def _failed(self, kind: str, message: str, row_id: str, t0: float) -> RewardResult:
        self.stats[kind] += 1
        self.stats["failed"] += 1
        log.warning("reward %s for row %s scored 0: %s", self.cfg.name, row_id or "?", message)
        return RewardResult(0.0, {}, message, time.perf_counter() - t0)

    def close(self) -> None:
        """Stop the workers; calls in flight and later ones score 0 (an error saying so)."""
        self._closed = True
        _stop_quietly(self._pool)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
