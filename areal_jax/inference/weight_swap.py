"""How an engine takes new weights while it serves: read and converted outside its lanes' locks
(``prepare_weights``), swapped in between two steps under them (``swap_weights``,
``update_weights``, ``set_state`` for arrays already placed), and where the served weights and KV
cache live (``placement``). A mixin of ``inference.base.EngineBase``, which owns the locks, the
lanes and the served ``nnx.State``."""

from __future__ import annotations

import asyncio
from typing import Any

import jax
import numpy as np
from flax import nnx

from areal_jax.inference.weights import WeightStage, check_swappable, new_state
from areal_jax.models.layer_stack import split_layers, stacked_view

__all__ = ["WeightSwaps"]


class WeightSwaps:
    """``EngineBase``'s weight updates (see the module docstring)."""

    async def update_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                             stage: WeightStage | None = None, version: int) -> None:
        """Swap in new weights: HF-named ``tensors`` (any subset), a whole HF ``model_dir``, or a
        ``stage`` (``stage_weights``) filled part by part.

        Nothing changes unless every tensor is valid; on error the old weights keep serving and
        the error is raised. The new weights are read and converted while generation goes on; the
        lanes stop only for the swap. Retracted requests recompute their KV under the new weights;
        ``in_place`` ones keep their (stale) KV.
        """
        async with self._update_lock:
            state = await self.prepare_weights(tensors, model_dir=model_dir, stage=stage)
            await self._swap(state, version)

    async def prepare_weights(self, tensors: dict[str, np.ndarray] | None = None, *, model_dir: str | None = None,
                              stage: WeightStage | None = None) -> Any:
        """New weights (one source, as ``update_weights`` takes them) read, converted and placed
        like the served ones in a worker thread while generation goes on, but not served: hand
        them to ``swap_weights``, which only swaps. Raises on invalid weights."""
        def build() -> Any:  # committed like the served state, so the compiled steps take it as it is
            state = new_state(self.model, tensors=tensors, model_dir=model_dir, stage=stage)
            # new stacked parameters into the serving layout, each freed once split
            return self._committed(split_layers(state, like=self._state, consume=True), like=self._state)

        return await asyncio.to_thread(self._in_mesh, build)

    async def swap_weights(self, state: Any, *, version: int) -> None:
        """Serve ``state`` (from ``prepare_weights``) from the next step on: the lanes stop only
        for the swap."""
        check_swappable(self._state, state)
        async with self._update_lock:
            await self._swap(state, version)

    async def _swap(self, state: Any, version: int) -> None:
        async with self._all_lanes():
            nnx.update(self.model, state)
            self._state = state
            self._version = version

    def stage_weights(self, *, hf_layout: bool = True) -> WeightStage:
        """An empty ``WeightStage`` for the next weights of the served model, to fill part by part
        (the buckets of an HTTP push) while this version serves; then ``update_weights(stage=)``.
        ``hf_layout=False``: the kernels come in our own layout (see ``iter_hf_tensors``)."""
        return WeightStage(self.model, hf_layout=hf_layout)

    @property
    def state(self) -> Any:
        """The served model's ``nnx.State`` in the serving layout (layer parameters as
        ``layer_stack.LayerStack`` s): the tree, dtypes and shardings ``set_state`` wants."""
        return self._state

    def placement(self) -> dict[str, Any]:
        """Where the served weights and the KV cache live, as JSON (for /get_server_info): the
        mesh's axis sizes, and each parameter's and the first lane's cache arrays' (stacked over
        layers) partition spec and per-device shape; ``{"mesh": None}`` on one device."""
        if self.mesh is None:
            return {"mesh": None}
        cache = self._lanes[0].cache
        return {"mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
                "params": _placement(stacked_view(self._state)),
                "kv_cache": {} if cache is None else _placement({"k": cache.k, "v": cache.v})}

    async def set_state(self, state: Any, *, version: int) -> None:
        """Serve ``state`` (device arrays already on this engine's shardings and dtypes, e.g. an
        in-process trainer's params handed over) as ``version``, swapped in between steps. The
        arrays of a state in the serving layout (``self.state``'s) are used as they are, not
        copied: whoever made them must not delete them while they are served. A state with stacked
        layer parameters (``layer_stack.stacked_view(self.state)``'s tree, a trainer's) is split
        into the serving layout between steps, each layer written into the buffer of the served
        layer it replaces (donated, ``split_layers(reuse=True)``): the engine never holds its layer
        parameters twice, and the stacked arrays stay the caller's. Weights prepared or staged
        before (``prepare_weights``, ``stage_weights``) share the served arrays they leave as they
        are, so after such a split they are refused: prepare them again. A tree, shape, dtype or
        sharding that differs raises before any change."""
        check_swappable(stacked_view(self._state), stacked_view(state))  # before any buffer is donated
        async with self._update_lock, self._all_lanes():
            state = self._in_mesh(split_layers, state, like=self._state, reuse=True)
            nnx.update(self.model, state)
            self._state = state
            self._version = version



def _placement(tree: Any) -> dict[str, dict[str, list]]:
    """Each array of ``tree`` by dotted path: its partition spec and the shape each device holds."""
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
        name = ".".join(str(k) for k in keys if k != "value")  # nnx.Param's .value is not part of the name
        spec = getattr(x.sharding, "spec", ())
        out[name] = {"spec": [list(a) if isinstance(a, tuple) else a for a in spec],
                     "shard_shape": list(x.sharding.shard_shape(x.shape))}
    return out
