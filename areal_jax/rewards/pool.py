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
import logging
import multiprocessing
import resource
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
    """``code``: address-space limit of the sandboxed program."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {self.num_workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")

    def fn_kwargs(self) -> dict[str, Any]:
        if self.name == "code":
            return {"all_or_nothing": self.code_all_or_nothing, "timeout_s": self.code_timeout_s,
                    "memory_mb": self.code_memory_mb}
        return {}


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
    """The pool's workers cannot start, so no call can score: raised by every call instead of a
    0, since a run that went on would train on rewards that say nothing (the controller stops
    the run with it)."""


class RewardPool:
    """``await pool.score(prompt, completion, fields, row_id=...)`` -> ``RewardResult``."""

    def __init__(self, cfg: RewardConfig | None = None):
        from pebble import ProcessPool

        from areal_jax.rewards import get_reward_fn

        self.cfg = cfg or RewardConfig()
        get_reward_fn(self.cfg.name)  # an unknown name fails here, before any work starts
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["areal_jax.rewards.builtin", *_PRELOAD.get(self.cfg.name, ())])
        self._pool = ProcessPool(max_workers=self.cfg.num_workers, initializer=_init_worker,
                                 initargs=(self.cfg.memory_mb,), context=ctx)
        self.stats: Counter = Counter()
        self._broken: str | None = None
        """``RewardPoolBroken``'s message once the workers could not start (pebble's pool refuses
        every later call with a bare ``RuntimeError``)."""

    async def score(self, prompt: str, completion: str, reward_fields: dict[str, Any] | None = None, *,
                    row_id: str = "") -> RewardResult:
        from pebble import ProcessExpired

        t0 = time.perf_counter()
        self.stats["calls"] += 1
        if self._broken is not None:
            self.stats["pool_broken"] += 1
            raise RewardPoolBroken(self._broken)
        future = self._pool.schedule(_call, args=(self.cfg.name, prompt, completion, dict(reward_fields or {}),
                                                  self.cfg.fn_kwargs()), timeout=self.cfg.timeout_s)
        try:
            value, extra = normalise(await asyncio.wrap_future(future))
        except (TimeoutError, concurrent.futures.TimeoutError):
            return self._failed("timeouts", f"timed out after {self.cfg.timeout_s}s", row_id, t0)
        except ProcessExpired as e:
            return self._failed("worker_died", f"worker died (exit code {e.exitcode})", row_id, t0)
        except MemoryError:
            return self._failed("memory", f"ran out of memory (limit {self.cfg.memory_mb} MiB)", row_id, t0)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BrokenProcessPool as e:
            if self._broken is None:
                self._broken = f"reward pool {self.cfg.name!r}: {BROKEN_POOL.format(error=e)}"
                log.error("%s", self._broken)
            self.stats["pool_broken"] += 1
            raise RewardPoolBroken(self._broken) from e
        except Exception as e:
            return self._failed("errors", f"{type(e).__name__}: {e}", row_id, t0)
        self.stats["ok"] += 1
        return RewardResult(value, extra, None, time.perf_counter() - t0)

    def _failed(self, kind: str, message: str, row_id: str, t0: float) -> RewardResult:
        self.stats[kind] += 1
        self.stats["failed"] += 1
        log.warning("reward %s for row %s scored 0: %s", self.cfg.name, row_id or "?", message)
        return RewardResult(0.0, {}, message, time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=10)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
