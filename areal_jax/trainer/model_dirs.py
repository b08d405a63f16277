"""Where a run's model comes from: the base model directory (a local HF model, one downloaded
from a URL, or a tiny random model written for the run), and the directory a resumed run loads
before its checkpoint's params replace the weights."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from areal_jax.trainer.run_config import RunConfig


def prepare_model_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """The base model directory: ``model.path`` (a URL is downloaded into ``<run dir>/base``), or
    a tiny model built in ``<run dir>/base`` (anew each run, so a changed ``model`` section never
    meets a stale checkpoint; it takes a second). ``run_dir`` is this process's own directory."""
    from areal_jax.models.hf_write import is_url

    if cfg.model.path is not None and is_url(cfg.model.path):
        from areal_jax.trainer.run_dir import fetch_url

        return fetch_url(cfg.model.path, run_dir / "base")
    if cfg.model.path is not None:
        path = Path(cfg.model.path)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path={path}: no config.json there; point it at a HF model directory")
        return path
    from areal_jax.models.tiny import make_tiny_checkpoint

    base = clear_tiny_base(run_dir)
    # Written aside and renamed into place: a server waiting for it (``--wait-for-model``) sees
    # config.json only once every file is there.
    partial = run_dir / f"base.partial-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    make_tiny_checkpoint(partial, model_type=cfg.model.model_type, size=cfg.model.tiny, seed=cfg.seed,
                         **cfg.model.tiny_options)
    if base.exists():
        shutil.rmtree(base)
    os.rename(partial, base)
    return base


def clear_tiny_base(run_dir: Path) -> Path:
    """Remove an earlier run's tiny model from ``<run dir>/base`` (before a server waits for the
    new one there); returns the path."""
    base = run_dir / "base"
    if base.exists():
        shutil.rmtree(base)
    return base


def base_dir(cfg: RunConfig, run_dir: Path) -> Path:
    """Where ``prepare_model_dir`` puts (or finds) the base model, without building it."""
    from areal_jax.models.hf_write import is_url

    return Path(cfg.model.path) if cfg.model.path is not None and not is_url(cfg.model.path) else run_dir / "base"


def resume_model_dir(cfg: RunConfig, run_dir: Path, base: Path) -> Path:
    """Where a resumed run loads its model from before the checkpoint's params replace it: the
    warm-started policy when there was a warm start (it is the KL reference), else ``base``."""
    warm = run_dir / "warm_start"
    if cfg.warm_start is None or (warm / "config.json").exists():
        return warm if cfg.warm_start is not None else base
    if cfg.algo.uses_reference:
        raise FileNotFoundError(f"resuming needs {warm}, the warm-started policy that is the KL reference "
                                "(algo.kl_coef or algo.kl_loss_coef > 0); it is gone")
    return base
