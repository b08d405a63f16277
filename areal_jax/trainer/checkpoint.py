"""Run checkpoints (orbax): when an RL run saves itself, where, and how it comes back.

A checkpoint is one orbax step directory with two items: ``state``, the trainer's arrays (policy
params, AdamW state, and with a critic its params and AdamW state), and ``meta``, JSON: the RL
step and policy version, the trainer's optimizer step, the prompt iterator's state, the
controller's counters and the prompts in flight, and the run's host RNG states. Nothing is
pickled.

Saving is asynchronous by default: ``save`` blocks only while the arrays are copied off the
devices, and the files are written in the background while training goes on. Orbax writes into
``<step>.orbax-checkpoint-tmp`` and renames (or, on object stores, writes ``commit_success.txt``)
only when every file is down, so a run killed mid-save leaves a directory that ``latest_step``
never picks up (and the next run deletes). A save that fails (the disk full) raises a
``CheckpointSaveError`` naming the directory; the checkpoints before it are left as they were.

The directory is an ``etils.epath.Path``: a local path or a ``gs://`` URL, handled alike by
orbax; nothing here uses ``os.path`` or ``pathlib`` on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from etils import epath

log = logging.getLogger(__name__)


@dataclass
class CheckpointConfig:
    """The ``checkpoint:`` section: when a run saves itself and where (``--resume`` continues it)."""

    dir: str | None = None
    """Where checkpoints go: a directory or a ``gs://bucket/path`` URL (needs ``gcsfs``); None:
    ``<run dir>/checkpoints``."""
    every_steps: int = 0
    """Save every this many RL steps; 0: not by step count."""
    every_seconds: float = 1800.0
    """Save when this many seconds have passed since the last save; 0: not by time. With both
    ``every_*`` at 0 the run saves no checkpoint; otherwise the last step is saved too."""
    keep: int = 3
    """Keep the newest this many checkpoints (older ones are deleted once a newer one is complete)."""
    async_save: bool = True
    """Write in the background: a save blocks training only while the arrays leave the devices."""

    def __post_init__(self) -> None:
        if self.every_steps < 0 or self.every_seconds < 0:
            raise ValueError(f"checkpoint.every_steps ({self.every_steps}) and checkpoint.every_seconds "
                             f"({self.every_seconds}) must be >= 0 (0: off)")
        if self.keep < 1:
            raise ValueError(f"checkpoint.keep must be >= 1, got {self.keep}")

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0 or self.every_seconds > 0


class CheckpointError(RuntimeError):
    """A run's checkpoints cannot be used as asked (the message says what would fix it)."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (the disk full, no permission): the message names the
    directory and the last complete checkpoint, which is intact."""


def checkpoint_dir(cfg: CheckpointConfig, run_dir: str) -> epath.Path:
    """``checkpoint.dir``, or ``<run dir>/checkpoints``. A URL (``gs://...``) is kept as it is; a
    local path is made absolute (orbax wants one). Touches no filesystem."""
    raw = cfg.dir if cfg.dir is not None else f"{str(run_dir).rstrip('/')}/checkpoints"
    if "://" in raw:
        return epath.Path(raw)
    return epath.Path(os.path.abspath(os.path.expanduser(raw)))


def rng_state() -> dict[str, Any]:
    """The host RNGs a run seeds (Python's ``random``, NumPy's global one) as JSON."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, np.uint32), pos, has_gauss, cached))


class RunCheckpoints:
    """One run's orbax ``CheckpointManager``: the save schedule, saves whose failures say what
    happened, and restores onto the caller's shardings (any mesh)."""

    def __init__(self, cfg: CheckpointConfig, directory: epath.Path):
        import orbax.checkpoint as ocp

        self.cfg, self.directory = cfg, directory
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(cfg.keep),
            enable_async_checkpointing=cfg.async_save, cleanup_tmp_directories=True, create=True)
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))
        self.last_complete = self.manager.latest_step()
        """The newest checkpoint known to be complete on storage."""
        self._pending: int | None = None
        self._last_save = time.monotonic()

    def latest_step(self) -> int | None:
        """The newest complete checkpoint (half-written ones are never listed)."""
        return self.manager.latest_step()

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether ``step`` is to be saved: every ``every_steps``, after ``every_seconds``, the last step."""
        c = self.cfg
        if not c.enabled:
            return False
        self._surface_errors(block=False)  # a failed background save stops the run at the next step
        return (last or (c.every_steps > 0 and step % c.every_steps == 0)
                or (c.every_seconds > 0 and time.monotonic() - self._last_save >= c.every_seconds))

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> float:
        """Save ``state`` (a pytree of arrays) and ``meta`` (JSON) as ``step``; returns the seconds
        it blocked. With ``async_save`` the files are written in the background; a failure of an
        earlier background write is raised here (or by ``wait``/``close``)."""
        t0 = time.perf_counter()
        self._surface_errors(block=True)  # orbax would wait for it anyway
        try:
            self.manager.save(step, force=True, args=self._ocp.args.Composite(
                state=self._ocp.args.StandardSave(state), meta=self._ocp.args.JsonSave(meta)))
        except Exception as e:
            # A save that failed in its blocking part may have started background writes of the
            # same step already: let them end (failing too) before the error leaves, so nothing
            # writes into the half-made step's directory after it (a new manager, as a resumed
            # run makes, deletes that directory; a write after that left files behind).
            with contextlib.suppress(Exception):
                self.manager.wait_until_finished()
            raise self._error(step, e) from e
        self._pending = step
        self._last_save = time.monotonic()
        if not self.cfg.async_save:
            self._surface_errors(block=True)
        return time.perf_counter() - t0

    def wait(self) -> None:
        """Block until a background save is complete; raises ``CheckpointSaveError`` if it failed."""
        self._surface_errors(block=True)

    def _surface_errors(self, *, block: bool) -> None:
        if self._pending is None or (not block and self.manager.is_saving_in_progress()):
            return
        step, self._pending = self._pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._error(step, e) from e
        self.last_complete = step

    def _error(self, step: int, e: BaseException) -> CheckpointSaveError:
        prev = (f"the last complete checkpoint, step {self.last_complete}, is intact and `--resume` restarts "
                f"from it" if self.last_complete is not None else "no earlier checkpoint exists")
        return CheckpointSaveError(
            f"could not write checkpoint step {step} to {self.directory}: {type(e).__name__}: {e}. Is the disk "
            f"full or the directory not writable? {prev}; free space (or set checkpoint.dir / checkpoint.keep) "
            "and resume")

    def read_meta(self, step: int) -> dict[str, Any]:
        """The JSON item of checkpoint ``step``."""
        out = self.manager.restore(step, args=self._ocp.args.Composite(meta=self._ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore_state(self, step: int, like: Any) -> Any:
        """The arrays of checkpoint ``step``, each restored straight onto the sharding of its
        counterpart in ``like`` (same tree; arrays or ``jax.ShapeDtypeStruct`` with shardings),
        whatever mesh the checkpoint was saved from."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        out = self.manager.restore(step, args=self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore(abstract)))
        return out["state"]

    def delete_all(self) -> None:
        """Delete every checkpoint in the directory."""
        for step in self.manager.all_steps():
            self.manager.delete(step)
        self.last_complete = None

    def close(self) -> None:
        """Wait for a background save (raising if it failed), then release the manager."""
        try:
            self.wait()
        finally:
            self.manager.close()
