"""Shared fixtures: sharpened tiny checkpoints (two weight versions) and the model they load."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_jax.inference import Engine, EngineConfig
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import sharpened_checkpoint


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharpened_checkpoint(tmp_path_factory.mktemp("ckpt") / "v0", seed=0)


@pytest.fixture(scope="session")
def ckpt_v1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Other weights of the same architecture, for weight-update tests."""
    return sharpened_checkpoint(tmp_path_factory.mktemp("ckpt") / "v1", seed=1)


@pytest.fixture(scope="session")
def model(ckpt: Path) -> Decoder:
    return load_pretrained(ckpt)


# One engine for the whole session, in two lanes of four slots (the harder scheduling path):
# compiling a step shape takes about a second on CPU. Tests that change its weights put the
# original ones back. A fixed seed: tests that count tokens without ignore_eos must not draw an EOS by chance.
ENGINE_CFG = EngineConfig(num_slots=8, max_seq_len=64, max_prefill_batch=4, decode_steps=4, lanes=2, seed=0)


@pytest.fixture(scope="session")
def engine(ckpt: Path) -> Engine:
    """Owns its own copy of the v0 weights, so weight updates never touch the reference ``model``."""
    return Engine(load_pretrained(ckpt), ENGINE_CFG)


@pytest.fixture(scope="session")
def slot_engine(engine: Engine, ckpt: Path) -> Engine:
    """The slot-cache engine, for tests of what only it has (lanes, its waiting queue): the
    shared ``engine``, or one of its own when ``AREAL_JAX_KV_CACHE=paged`` made that one paged."""
    if engine.cfg.kv_cache == "slots":
        return engine
    return Engine(load_pretrained(ckpt), EngineConfig(**{**vars(ENGINE_CFG), "kv_cache": "slots"}))
