"""Fixtures of the rollout_bridge tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_jax.models.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", model_type="qwen2", size="tiny")
