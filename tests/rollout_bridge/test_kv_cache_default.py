"""Which KV cache a user gets: the page pool by default (a config, `areal-jax serve`'s flags, the
in-process engine of `rollout.backend=local`), the slot cache when asked for by flag or
environment, and the slot cache with a log line where the pool cannot run (data parallelism)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from areal_jax.inference.config import KV_CACHE_ENV, EngineConfig
from rollout_bridge.serve import engine_config, parser


def _args(*flags: str):  # noqa: ANN202 - an argparse namespace
    return parser().parse_args(["--model-path", "unused", *flags])


def test_the_page_pool_is_the_default_and_slots_stay_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    assert EngineConfig().kv_cache == "paged"
    assert engine_config(_args(), 64).kv_cache == "paged"
    assert engine_config(_args("--kv-cache", "slots"), 64).kv_cache == "slots"
    monkeypatch.setenv(KV_CACHE_ENV, "slots")
    assert EngineConfig().kv_cache == "slots"
    assert engine_config(_args(), 64).kv_cache == "slots"
    assert engine_config(_args("--kv-cache", "paged"), 64).kv_cache == "paged"  # the flag wins
    monkeypatch.setenv(KV_CACHE_ENV, "")  # set but empty: the default, not an error
    assert EngineConfig().kv_cache == "paged"
    monkeypatch.setenv(KV_CACHE_ENV, "page")
    with pytest.raises(ValueError, match=f"got 'page'.*{KV_CACHE_ENV}"):
        EngineConfig()


def test_data_parallel_falls_back_to_slots_and_says_so(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="rollout_bridge.serve"):
        assert engine_config(_args(), 64, data_parallel=True).kv_cache == "slots"
    assert any("KV cache: slots" in r.getMessage() and "data-parallel" in r.getMessage() for r in caplog.records)
    with pytest.raises(SystemExit, match="--kv-cache paged does not split over one mesh"):
        engine_config(_args("--kv-cache", "paged"), 64, data_parallel=True)


def test_the_local_backend_engine_is_paged_by_default(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_jax.inference.paged import PagedEngine
    from rollout_bridge.local import build_engine

    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    engine = build_engine(tiny_dir, ["--max-running-requests", "4", "--context-length", "64"])
    assert isinstance(engine, PagedEngine) and engine.server_info()["kv_cache"] == "paged"
    slots = build_engine(tiny_dir, ["--max-running-requests", "4", "--context-length", "64", "--kv-cache", "slots"])
    assert not isinstance(slots, PagedEngine) and slots.server_info()["kv_cache"] == "slots"
