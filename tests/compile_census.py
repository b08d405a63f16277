"""Where a test run's compile time goes: a pytest plugin that logs every XLA compilation and every
persistent-cache load, with the test that caused it, and a summary per test file.

    python -m pytest -p tests.compile_census tests/...        # writes $COMPILE_CENSUS or .cache/compile-census.jsonl
    python -m tests.compile_census .cache/compile-census.jsonl [N]

Each line of the log is one program: ``ev`` ("compile": compiled and written to the cache; "hit":
loaded from it), ``mod`` (the jitted function's module name, e.g. ``jit_mixed_step``), ``key`` (the
cache key: the same key twice is the same program), ``s`` (seconds, the cache write or read
included), ``test`` (node id) and ``pid``. Child processes (servers, ``areal-jax train`` runs) are
counted when they keep the ``PYTHONPATH`` they inherit: the plugin puts a ``sitecustomize`` first on
it. A child started with ``PYTHONPATH`` replaced is not counted; its compiling shows only as its
test's time.

It wraps two private functions of ``jax._src.compiler`` (checked on jax 0.10): a measurement aid,
never loaded by the suite itself.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

LOG_ENV, TEST_ENV = "COMPILE_CENSUS", "COMPILE_CENSUS_TEST"
ENGINE = frozenset({"jit_mixed_step", "jit_decode_step", "jit_prefill_step", "jit__prefill", "jit__decode",
                    "jit__share", "jit__prefill_chunk"})
TRAINER = frozenset({"jit__grad_step", "jit__apply_step", "jit__forward_step", "jit_compute_advantages"})


def _write(rec: dict[str, Any]) -> None:
    rec.update(pid=os.getpid(), test=os.environ.get(TEST_ENV, "?"))
    fd = os.open(os.environ[LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(rec) + "\n").encode())  # one write: whole lines from many processes
    except OSError:
        pass  # a test that limits file sizes (a full disk) must not fail on the census
    finally:
        os.close(fd)


def _patch(compiler: Any) -> None:
    if getattr(compiler._compile_and_write_cache, "census", False):
        return  # patched already (by this file loaded under another name: see pytest_configure)
    compile_and_write, cache_read = compiler._compile_and_write_cache, compiler._cache_read

    def compiled(backend: Any, computation: Any, devices: Any, options: Any, callbacks: Any, module: str,
                 key: str) -> Any:
        t = time.monotonic()
        out = compile_and_write(backend, computation, devices, options, callbacks, module, key)
        _write({"ev": "compile", "mod": module, "key": key[-64:], "s": time.monotonic() - t})
        return out

    def read(module: str, key: str, *args: Any, **kwargs: Any) -> Any:
        t = time.monotonic()
        out = cache_read(module, key, *args, **kwargs)
        if out[0] is not None:
            _write({"ev": "hit", "mod": module, "key": key[-64:], "s": time.monotonic() - t})
        return out

    compiled.census = True  # type: ignore[attr-defined]
    compiler._compile_and_write_cache, compiler._cache_read = compiled, read


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``jax._src.compiler`` when it is first imported, so that a process that never
    imports jax pays nothing."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "jax._src.compiler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Count this process's compilations (before or after jax is imported); once per process."""
    if "jax._src.compiler" in sys.modules:
        _patch(sys.modules["jax._src.compiler"])
    elif not any(type(f).__name__ == _PatchOnImport.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def pytest_configure(config: Any) -> None:
    root = Path(__file__).resolve().parents[1]
    os.environ.setdefault(LOG_ENV, str(root / ".cache" / "compile-census.jsonl"))
    site = Path(tempfile.mkdtemp(prefix="compile-census-"))
    # Loaded under a name of its own: importing ``tests.compile_census`` before pytest does would
    # stop pytest from rewriting its asserts (a warning in every xdist worker).
    (site / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_compile_census', {str(Path(__file__).resolve())!r})\n"
        "census = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(census)\ncensus.install()\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(root), os.environ.get("PYTHONPATH")) if p)
    install()


def pytest_runtest_setup(item: Any) -> None:
    os.environ[TEST_ENV] = item.nodeid  # children started by the test inherit it


def summary(records: list[dict[str, Any]], top: int = 40) -> str:
    """Per test file: compiles and their seconds, cache loads and theirs, the costliest modules; then
    the totals by kind (engine steps, trainer steps, the rest) and how many compiles repeated a key
    (a program compiled twice: two processes at once, or a cache miss)."""
    per: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
    mods: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    kinds: collections.Counter = collections.Counter()
    keys: collections.Counter = collections.Counter()
    for r in records:
        p = per[r["test"].split("::")[0]]
        if r["ev"] == "compile":
            p[0] += 1
            p[1] += r["s"]
            mods[r["test"].split("::")[0]][r["mod"]] += r["s"]
            kinds["engine" if r["mod"] in ENGINE else "trainer" if r["mod"] in TRAINER else "other"] += r["s"]
            keys[r["key"]] += 1
        elif r["ev"] == "hit":
            p[2] += 1
            p[3] += r["s"]
    lines = ["compile s  compiles  loads  load s  file: costliest modules (s)"]
    for f, (n, s, h, hs) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
        costly = ", ".join(f"{m}:{v:.0f}" for m, v in mods[f].most_common(3))
        lines.append(f"{s:9.1f} {n:9d} {h:6d} {hs:7.1f}  {f}: {costly}")
    n, s = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    h, hs = sum(v[2] for v in per.values()), sum(v[3] for v in per.values())
    lines.append(f"total: {n} compiles {s:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in kinds.items())}); "
                 f"{h} loads {hs:.0f} s; {sum(c - 1 for c in keys.values())} compiles of a key compiled before")
    return "\n".join(lines)


if __name__ == "__main__":
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    print(summary(rows, int(sys.argv[2]) if len(sys.argv) > 2 else 40))
