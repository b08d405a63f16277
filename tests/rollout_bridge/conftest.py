"""Fixtures of the rollout_bridge tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_jax.models.tiny import make_tiny_checkpoint
from tests.rollout_bridge.bridge_helpers import ServerThread


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", model_type="qwen2", size="tiny")


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    """One embedded server in the default configuration, shared by a module's tests (a module
    that needs another configuration defines its own ``server``)."""
    with ServerThread(tiny_dir) as srv:
        yield srv
