"""The serving layout (models.layer_stack): layer parameters held one array per layer, which the
decode loop reads in place instead of slicing (and, on a GPU, copying) a stacked weight each step."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from areal_jax.inference import Engine, EngineConfig
from areal_jax.inference.pages import PageAllocator, PageTable
from areal_jax.models import load_pretrained
from areal_jax.models.layer_stack import LayerStack, join_layers, split_layers, stacked_view
from tests.models.test_paged_attention import _run, _step

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _is_stack(x: object) -> bool:
    return isinstance(x, LayerStack)


def _split(model: nnx.Module) -> nnx.Module:
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, split_layers(state))


def test_split_layers_keeps_every_value_and_describes_itself_as_the_stack() -> None:
    model = load_pretrained(FIXTURES / "hf_qwen2")
    layers = model.config.num_hidden_layers
    _, state = nnx.split(model)
    split = split_layers(state)
    stacked = jax.tree_util.tree_leaves_with_path(state)
    served = jax.tree.leaves(split, is_leaf=_is_stack)
    assert sum(_is_stack(x) for x in served) == len(jax.tree.leaves(nnx.state(model.layers))) > 0
    for (path, a), b in zip(stacked, served, strict=True):
        if "layers" in jax.tree_util.keystr(path):
            assert _is_stack(b) and len(b.layers) == layers
            assert (b.shape, b.dtype) == (a.shape, a.dtype) and b.sharding.is_equivalent_to(a.sharding, a.ndim)
            assert all(x.shape == a.shape[1:] for x in b.layers)
            np.testing.assert_array_equal(np.asarray(b.stacked()), np.asarray(a))
        else:
            assert b is a  # embeddings, final norm: untouched
    view = stacked_view(split)
    assert jax.tree.structure(view) == jax.tree.structure(state)
    assert [(v.shape, v.dtype) for v in jax.tree.leaves(view)] == [(a.shape, a.dtype) for _, a in stacked]
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(join_layers(split)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert split_layers(split) is not split and all(  # splitting again changes nothing
        x is y for x, y in zip(jax.tree.leaves(split), jax.tree.leaves(split_layers(split)), strict=True))


def _weight_slices(hlo: str, shapes: set[tuple[int, ...]]) -> list[str]:
    """Slicing instructions of an optimised HLO module that cut a layer weight's shape (a leading
    1 of a one-layer slice dropped) out of a larger array."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*f32\[([\d,]*)\][^ ]*\s+(dynamic-slice|slice)\(", line)
        if m:
            dims = tuple(int(d) for d in m.group(1).split(",") if d)
            while dims[:1] == (1,):
                dims = dims[1:]
            if dims in shapes:
                found.append(line.strip())
    return found


def test_a_split_model_decodes_as_the_stacked_one_and_slices_no_weight() -> None:
    """Paged prefill and two decode steps give the stacked model's logits; the compiled step of the
    split model takes each layer's weights as they are, where the stacked one slices every layer's
    out of its stack inside the layer loop (the copy a GPU made each step)."""
    stacked = load_pretrained(FIXTURES / "hf_qwen2")
    split = _split(stacked)
    shapes = {tuple(x.shape[1:]) for x in jax.tree.leaves(nnx.state(stacked.layers)) if x.ndim >= 3}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (5, 9)]
    results = []
    for model in (stacked, split):
        pool = PageAllocator(num_pages=16, page_size=4)
        cache = model.init_paged_cache(pool.num_pages, pool.page_size)
        tables = [PageTable(pool) for _ in prompts]
        logits, cache = _run(model, cache, tables, prompts, [0, 0], 16)
        steps = [logits[i, len(p) - 1] for i, p in enumerate(prompts)]
        for k in range(2):
            at = [len(p) + k for p in prompts]
            logits, cache = _run(model, cache, tables, [[7 + k], [9 + k]], at, 1)
            steps += [logits[0, 0], logits[1, 0]]
        results.append(np.stack(steps))
        # the compiled decode call of one token a row, as the engine's loop makes it
        args = (jnp.zeros((2, 1), jnp.int32), jnp.asarray([[5], [9]], jnp.int32), cache,
                jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                tuple(jnp.zeros(8, jnp.int32) for _ in range(3)))
        hlo = _step.lower(model, *args).compile().as_text()
        if model is stacked:
            assert _weight_slices(hlo, shapes), "the stacked model's step should slice its weights (the check is blind)"
        else:
            assert _weight_slices(hlo, shapes) == []
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def served() -> tuple[nnx.Module, Engine]:
    model = load_pretrained(FIXTURES / "hf_qwen2")
    return model, Engine(model, EngineConfig(num_slots=2, max_seq_len=32, max_prefill_batch=2, decode_steps=2))


def test_an_engine_serves_its_own_split_copy_and_leaves_the_callers_model_stacked(served) -> None:
    model, engine = served
    kernel = engine.model.layers.mlp.down_proj.kernel.get_value()
    assert _is_stack(kernel) and len(kernel.layers) == model.config.num_hidden_layers
    assert isinstance(model.layers.mlp.down_proj.kernel.get_value(), jax.Array)
    placement = engine.placement()
    assert placement == {"mesh": None}


def _served_layers(engine: Engine) -> list[jax.Array]:
    return [x for p in jax.tree.leaves(engine.state, is_leaf=_is_stack) if _is_stack(p) for x in p.layers]


def test_set_state_splits_a_stacked_state_into_the_served_layer_buffers(served) -> None:
    """A trainer's stacked state is split into the engine's own per-layer buffers, donated: after
    ``set_state`` every served layer array sits in the buffer of the one it replaced (same
    address), the replaced arrays are deleted, and the trainer's arrays are untouched, so the
    engine never holds its layer parameters twice. Before, the split made new buffers beside the
    served ones. A state that does not fit (another dtype) is refused before anything is donated,
    and weights prepared before the split, which share the replaced arrays, are refused by
    ``swap_weights`` naming the fix."""
    model, engine = served
    _, state = nnx.split(model)
    old = _served_layers(engine)
    addresses = [x.unsafe_buffer_pointer() for x in old]
    trainer = jax.tree.map(lambda x: x * 3, state)

    async def go() -> None:
        await engine.start()
        try:
            with pytest.raises(ValueError, match="bfloat16"):
                await engine.set_state(jax.tree.map(lambda x: x.astype(jnp.bfloat16), state), version=5)
            assert not any(x.is_deleted() for x in old) and engine.version == 0
            prepared = await engine.prepare_weights({"model.norm.weight": np.ones(32, np.float32)})
            await engine.set_state(trainer, version=1)
            with pytest.raises(ValueError, match="deleted array.*prepare them again"):
                await engine.swap_weights(prepared, version=2)
        finally:
            await engine.stop()

    asyncio.run(go())
    new = _served_layers(engine)
    assert engine.version == 1 and len(new) == len(old) > 0
    assert all(x.is_deleted() for x in old) and not any(x.is_deleted() for x in new)
    assert [x.unsafe_buffer_pointer() for x in new] == addresses
    assert not any(x.is_deleted() for x in jax.tree.leaves(trainer))
    for a, b in zip(jax.tree.leaves(join_layers(engine.state)), jax.tree.leaves(trainer), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_stacked_states_and_one_layers_update_reach_the_split_layout(served) -> None:
    """A trainer's stacked state is split on ``set_state``; an HF update of one layer's tensor
    changes that layer's array only, the other layers keep theirs."""
    model, engine = served
    _, state = nnx.split(model)
    kernel_of = lambda: engine.state["layers"]["mlp"]["down_proj"]["kernel"].get_value()  # noqa: E731
    name = "model.layers.1.mlp.down_proj.weight"
    new = np.full(model.layers.mlp.down_proj.kernel.get_value().shape[1:][::-1], 0.5, np.float32)  # HF: [out, in]

    async def go() -> tuple[list[np.ndarray], list[np.ndarray]]:
        await engine.start()
        try:
            await engine.set_state(jax.tree.map(lambda x: x * 2, state), version=1)
            before = [np.asarray(x) for x in kernel_of().layers]
            await engine.update_weights({name: new}, version=2)
            return before, [np.asarray(x) for x in kernel_of().layers]
        finally:
            await engine.stop()

    before, after = asyncio.run(go())
    want = np.asarray(model.layers.mlp.down_proj.kernel.get_value()) * 2
    np.testing.assert_array_equal(np.stack(before), want)
    assert _is_stack(kernel_of())
    np.testing.assert_array_equal(after[1], new.T)
    for i in (0, *range(2, len(before))):
        np.testing.assert_array_equal(after[i], before[i])
