"""Where a run's files live: a local directory, or a URL (``gs://bucket/runs/r1``, any fsspec
scheme) for hosts that share no filesystem.

With a local ``run_dir`` (shared between the hosts of a multi-host run, say over NFS) every file
is written there, as ever. With a URL, each process works in a local directory of its own
(``local_dir``; default ``~/.cache/areal-jax/runs/<the URL's path>``, with ``process-<i>``
under it when several processes run on one machine, as in tests) and the run directory proper
is reached through fsspec only:

* ``config.yaml``, ``metrics.jsonl``, ``tensorboard/``, ``curves.png`` and the servers' ``logs/``
  are written locally by process 0 and uploaded (``publish``) after every checkpoint and at the
  end of the run, so the copy at the URL is never behind the newest checkpoint;
* the base model: a tiny model is built by every process in its own local directory (it is
  seeded, so they are the same); a ``model.path`` URL is downloaded by every process;
* the warm-started policy and the exported policy are written to the URL by every process
  together (``save_pretrained``: each its own shards); whoever needs one locally (process 0's
  rollout servers; every process when a run resumes: the KL reference) downloads it (``fetch``);
* checkpoints go to ``<run dir>/checkpoints`` through orbax, which writes ``gs://`` itself.

A resumed run downloads ``metrics.jsonl`` and ``tensorboard/`` before it goes on.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from areal_jax import CACHE_ROOT
from areal_jax.models.hf_write import is_url


def local_run_dir(run_dir: str, local_dir: str | None = None) -> Path:
    """This process's working directory for ``run_dir``: the directory itself when it is local;
    for a URL, ``local_dir`` or a cache directory named after the URL, with ``process-<i>`` under
    it in a multi-process run (their files must never mix, even on one machine)."""
    if not is_url(run_dir):
        return Path(run_dir)
    import jax

    if local_dir is not None:
        base = Path(local_dir).expanduser()
    else:
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", run_dir.split("://", 1)[1].strip("/")) or "run"
        base = Path(CACHE_ROOT, "runs").expanduser() / name
    return base / f"process-{jax.process_index()}" if jax.process_count() > 1 else base


class RunDir:
    """A run's directory: ``root`` as configured (a local path or URL) and ``local``, where this
    process writes its own files. With a local ``root`` the two are one and ``publish`` and
    ``fetch`` do nothing."""

    OUTPUTS = ("config.yaml", "metrics.jsonl", "tensorboard", "curves.png", "logs")
    """What ``publish`` uploads by default: process 0's outputs."""

    def __init__(self, root: str | os.PathLike, local_dir: str | None = None):
        self.root = os.fspath(root).rstrip("/") or "/"
        self.remote = is_url(self.root)
        self.local = local_run_dir(self.root, local_dir)

    def __str__(self) -> str:
        return self.root

    def path(self, name: str) -> Path | str:
        """``name`` in the run directory: a local ``Path``, or a URL string."""
        return f"{self.root}/{name}" if self.remote else self.local / name

    def _fs(self) -> tuple[Any, str]:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.root)
        return fs, root.rstrip("/")

    def publish(self, *names: str) -> list[str]:
        """Upload these files or directories (default ``OUTPUTS``) from ``local`` to the URL,
        each file whole (a reader never sees half of one); returns the names uploaded."""
        if not self.remote:
            return []
        fs, root = self._fs()
        done = []
        for name in names or self.OUTPUTS:
            src = self.local / name
            if src.is_file():
                fs.makedirs(f"{root}/{Path(name).parent}".rstrip("/."), exist_ok=True)
                fs.put_file(str(src), f"{root}/{name}")
            elif src.is_dir():
                for file in sorted(p for p in src.rglob("*") if p.is_file()):
                    rel = file.relative_to(self.local).as_posix()
                    fs.makedirs(f"{root}/{Path(rel).parent.as_posix()}", exist_ok=True)
                    fs.put_file(str(file), f"{root}/{rel}")
            else:
                continue
            done.append(name)
        return done

    def remove(self, name: str) -> None:
        """Delete ``name`` at the URL (a run that starts afresh drops an earlier run's events,
        which uploads alone would never remove); nothing for a local run directory."""
        if not self.remote:
            return
        fs, root = self._fs()
        if fs.exists(f"{root}/{name}"):
            fs.rm(f"{root}/{name}", recursive=True)

    def fetch(self, name: str) -> Path | None:
        """Download ``name`` (a file or a directory) from the URL into ``local`` (replacing what is
        there) and return its local path; None when the URL has no ``name``. With a local run
        directory: the path when it exists, else None."""
        dest = self.local / name
        if not self.remote:
            return dest if dest.exists() else None
        fs, root = self._fs()
        src = f"{root}/{name}"
        if not fs.exists(src):
            return None
        if fs.isfile(src):
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(src, str(dest))
            return dest
        return _download_tree(fs, src, dest)


def _download_tree(fs: Any, src: str, dest: Path) -> Path:
    """Every file under ``src`` on ``fs`` into ``dest`` (replaced), keeping the layout."""
    import shutil

    shutil.rmtree(dest, ignore_errors=True)
    for file in fs.find(src):
        rel = file[len(src):].lstrip("/")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(file, str(dest / rel))
    return dest


def fetch_url(url: str, dest: Path) -> Path:
    """A model directory at ``url`` downloaded into ``dest`` (replacing it); every process of a
    run without a shared filesystem downloads its own copy."""
    import fsspec

    fs, src = fsspec.core.url_to_fs(url)
    src = src.rstrip("/")
    if not fs.exists(f"{src}/config.json"):
        raise FileNotFoundError(f"model.path={url}: no config.json there; point it at a HF model directory")
    return _download_tree(fs, src, dest)
