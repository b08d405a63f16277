"""``areal-jax`` with ``gs://`` served from a local directory: a stand-in bucket for tests of runs
whose hosts share no filesystem. Usage: ``python -m tests.trainer.fake_gs BUCKETS_DIR train ...``
(``gs://b/x`` is ``BUCKETS_DIR/b/x``); every access goes through fsspec, as with gcsfs."""

import sys

import fsspec
from fsspec.implementations.local import LocalFileSystem


class FakeGCS(LocalFileSystem):
    """fsspec's local filesystem under ``root``, answering to ``gs://`` URLs."""

    protocol = ("gs", "gcs")
    root = ""

    @classmethod
    def _strip_protocol(cls, path):  # noqa: ANN001, ANN206
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return f"{cls.root}/{path[len(prefix):].lstrip('/')}".rstrip("/")
        if path.startswith(cls.root) or path.startswith("/"):  # a bucket path already, or a local file (put/get)
            return path.rstrip("/") or "/"
        return f"{cls.root}/{path}".rstrip("/")

    def unstrip_protocol(self, name: str) -> str:
        return "gs://" + name[len(self.root):].lstrip("/")


def install(root: str) -> None:
    """Serve ``gs://`` from ``root`` in this process (replacing gcsfs, if installed)."""
    FakeGCS.root = root.rstrip("/")
    fsspec.register_implementation("gs", FakeGCS, clobber=True)
    fsspec.register_implementation("gcs", FakeGCS, clobber=True)


if __name__ == "__main__":
    install(sys.argv[1])
    from areal_jax.cli import main

    main(sys.argv[2:])
