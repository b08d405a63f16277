"""New weights for a served model, staged while the old ones keep serving.

A weight push arrives in parts (the buckets of an HTTP push) or all at once (a checkpoint
directory). ``WeightStage`` checks each part as it comes (names, shapes, nothing sent twice),
then converts every parameter whose HF tensors have all arrived onto the devices (a copy of the
served model that shares its untouched arrays), so the conversion of one bucket runs while the
next is still on the wire. ``finish`` converts what is left and returns the state the engine
swaps in. Nothing touches the served model: a stage that fails or is dropped just goes away.
``new_state`` builds the state from any one source, and ``check_swappable`` checks that a state
made elsewhere (an in-process trainer's) fits where the served one is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import (
    CheckpointError,
    _hf_params,
    assign_hf_tensors,
    check_hf_tensors,
    hf_tensor_specs,
    read_hf_dir,
)


class WeightStage:
    """The next weights of ``model``, HF-named tensors in any number of parts (see the module
    docstring). Not thread-safe: one part at a time."""

    def __init__(self, model: Decoder, *, hf_layout: bool = True):
        self.staged = nnx.clone(model)  # shares the untouched arrays: no copy of the model
        self.hf_layout = hf_layout
        """False: the kernels arrive in our own ``[in, out]`` layout (see ``iter_hf_tensors``)."""
        self._specs = hf_tensor_specs(model, hf_layout=hf_layout)
        self._path_of: dict[str, Any] = {}
        self._names_of: dict[Any, set[str]] = {}
        for group, _ in _hf_params(model):
            for p in group:
                self._path_of[p.hf_name] = p.path
                self._names_of.setdefault(p.path, set()).add(p.hf_name)
        self._waiting: dict[Any, dict[str, np.ndarray]] = {}
        self.received: set[str] = set()

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Raise ``CheckpointError`` for a tensor this model does not have, one of the wrong shape,
        or one already received; nothing is staged then."""
        check_hf_tensors(self._specs, tensors, self.staged.config.model_type)
        again = sorted(set(tensors) & self.received)
        if again:
            raise CheckpointError(f"tensors {again[:3]} sent twice in one update")

    def add(self, tensors: Mapping[str, np.ndarray], *, checked: bool = False) -> None:
        """Stage ``tensors`` (checked first unless ``checked``); every parameter now complete is
        converted onto the devices."""
        if not checked:
            self.check(tensors)
        self.received.update(tensors)
        complete: dict[str, np.ndarray] = {}
        for name, arr in tensors.items():
            path = self._path_of[name]
            waiting = self._waiting.setdefault(path, {})
            waiting[name] = arr
            if len(waiting) == len(self._names_of[path]):
                complete.update(self._waiting.pop(path))
        if complete:
            assign_hf_tensors(self.staged, complete, hf_layout=self.hf_layout)

    def missing(self) -> list[str]:
        """HF names not received yet."""
        return sorted(set(self._specs) - self.received)

    def finish(self) -> nnx.State:
        """The staged model's state: parameters only partly received keep the served values of the
        layers not sent (callers that need every tensor check ``missing()`` first)."""
        rest = {name: arr for waiting in self._waiting.values() for name, arr in waiting.items()}
        self._waiting.clear()
        if rest:
            assign_hf_tensors(self.staged, rest, hf_layout=self.hf_layout)
        return nnx.state(self.staged)


def stage_checkpoint(model: Decoder, model_dir: str) -> WeightStage:
    """A whole HF model directory staged for ``model`` (its files are mapped, and each tensor's
    bytes are read once, on their way to the devices)."""
    stage = WeightStage(model)
    try:
        stage.add(read_hf_dir(model_dir))
    except CheckpointError as e:
        raise CheckpointError(f"{model_dir}: parameters differ in names or shapes from the served model: {e}") from None
    if stage.missing():
        missing = stage.missing()
        raise CheckpointError(f"{model_dir}: parameters differ in names or shapes from the served model: "
                              f"{len(missing)} tensors missing, e.g. {missing[:3]}")
    return stage


def new_state(model: Decoder, *, tensors: Mapping[str, np.ndarray] | None = None, model_dir: str | None = None,
              stage: WeightStage | None = None) -> nnx.State:
    """``model``'s state with the new weights of exactly one source: HF-named ``tensors`` (any
    subset), a whole HF ``model_dir``, or a filled ``stage``. ``model`` is not touched."""
    if sum(x is not None for x in (tensors, model_dir, stage)) != 1:
        raise ValueError("new weights need exactly one of tensors, model_dir or stage")
    if model_dir is not None:
        stage = stage_checkpoint(model, model_dir)
    elif tensors is not None:
        stage = WeightStage(model)
        stage.add(tensors)
    assert stage is not None
    return stage.finish()


def check_swappable(served: Any, state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` has the tree, shapes, dtypes and shardings of the
    ``served`` state, so that it can serve in its place without a recompile or a copy; the
    message names the first parameter that differs."""
    if jax.tree.structure(served) != jax.tree.structure(state):
        raise ValueError("new weights: their parameter tree differs from the served model's; build them from "
                         "the same model class and config")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(served), jax.tree.leaves(state), strict=True):
        if isinstance(b, jax.Array) and b.is_deleted():
            raise ValueError(f"new weights: {jax.tree_util.keystr(path, simple=True, separator='.')} is a deleted "
                             "array (weights prepared before a set_state, which reused the served buffers they "
                             "shared); prepare them again")
        if a.shape != b.shape or a.dtype != b.dtype or not b.sharding.is_equivalent_to(a.sharding, a.ndim):
            raise ValueError(f"new weights: {jax.tree_util.keystr(path, simple=True, separator='.')} is {b.shape} "
                             f"{b.dtype} on {b.sharding}; the engine serves {a.shape} {a.dtype} on {a.sharding}")
