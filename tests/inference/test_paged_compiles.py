"""Background compiles of the paged engine's step shapes (``inference.paged_compiles``,
``PagedShapes.compile_in_background``): an engine started cold answers its first request while
the rest of its shapes still compile, padding its calls up to the widest shapes compiled first."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.paged import PagedEngine
from areal_jax.inference.paged_compiles import BackgroundCompiles
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import prompts, reference_greedy, run

# 32 running requests: decode calls of 8, 16 and 32 rows; chunks of 512 tokens: mixed steps of 8
# and 32 blocks of 16 tokens. One worker thread, so the compiles come in ``compile_order``.
CFG = EngineConfig(num_slots=32, max_seq_len=128, decode_steps=4, seed=0, kv_cache="paged", page_size=16,
                   max_total_tokens=2048, chunked_prefill_size=512, compile_threads=1)


def test_claim_takes_a_queued_shape_and_waits_for_one_in_hand() -> None:
    """A step that needs a shape no worker has started compiles it itself (the worker never
    does); one that needs the shape a worker compiles waits until it is compiled; a failed
    compile is counted and left to the step's own call, never raised by ``claim``."""
    started, release = threading.Event(), threading.Event()
    compiled: list[str] = []

    def compile_one(shape: str) -> None:
        if shape == "a":
            started.set()
            release.wait()
        if shape == "bad":
            raise RuntimeError("cannot compile")
        compiled.append(shape)

    compiles = BackgroundCompiles(["a", "b", "bad", "c"], compile_one, threads=1)
    assert started.wait(60)
    compiles.claim("b")  # queued behind "a": taken off the queue at once
    assert compiles.futures["b"].cancelled() and compiles.stats["claimed"] == 1
    assert compiles.running("a") and compiles.pending == ["a", "bad", "c"]
    claimed = threading.Event()
    waiter = threading.Thread(target=lambda: (compiles.claim("a"), claimed.set()))
    waiter.start()
    assert not claimed.is_set()  # "a" is in hand until released: claim cannot have returned
    release.set()
    waiter.join(60)
    assert claimed.is_set() and compiles.compiled("a") and compiles.stats["waits"] == 1
    compiles.futures["c"].result(60)
    compiles.claim("bad")  # failed: the step's own call compiles (and reports) it
    assert compiled == ["a", "c"] and compiles.stats["failed"] == 1 and compiles.stats["ahead"] == 2
    assert isinstance(compiles.futures["bad"].exception(), RuntimeError) and not compiles.pending
    compiles.close()


def test_compile_threads_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="compile_threads"):
        EngineConfig(compile_threads=-1)


@pytest.fixture(scope="module")
def cold(ckpt: Path) -> PagedEngine:
    engine = Engine(load_pretrained(ckpt), CFG)
    assert isinstance(engine, PagedEngine)
    return engine


def test_a_cold_engine_answers_while_its_other_shapes_still_compile(cold: PagedEngine, model: Decoder) -> None:
    """Started with nothing compiled, the engine compiles the widest mixed step and decode call
    first; a short prompt sent once those are compiled is answered (as the full-forward reference
    answers it) in calls padded up to them, while the worker still holds the next shape (held
    here until the answer is in): it waits for no other compile. Before, each call compiled its
    own shape first, one after another. Once every shape is compiled, calls take their own."""
    engine = cold
    order = engine.compile_order()
    widest = {order[0], order[1]}
    assert order[0] == engine._mixed_shape(32, 16) and order[1] == engine._decode_shape(32)  # noqa: SLF001
    held, release = threading.Event(), threading.Event()
    warm_call = engine._warm_call  # noqa: SLF001

    def holding(shape: tuple[Any, ...]) -> Any:
        if shape == order[2]:  # the third compile waits until the answer is in
            held.set()
            release.wait()
        return warm_call(shape)

    engine._warm_call = holding  # noqa: SLF001
    prompt = prompts([10], seed=3)[0]

    async def go() -> tuple[Any, bool, set]:
        await engine.start()
        try:
            assert await asyncio.to_thread(held.wait, 120)  # the widest two are compiled
            out = await engine.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0,
                                                                               ignore_eos=True)))
            compiles = engine.background_compiles
            in_hand = compiles is not None and compiles.running(order[2])
            called = set(engine.compiled_shapes)
            release.set()
            await asyncio.to_thread(compiles.futures[order[2]].result, 120)
            return out, in_hand, called
        finally:
            release.set()
            await engine.stop()

    try:
        out, in_hand, called = run(go())
    finally:
        del engine._warm_call  # noqa: SLF001
    assert out.output_ids == reference_greedy(model, prompt, 6)
    assert in_hand  # answered before the background compiles ended
    assert called == widest, called  # a 1-block chunk and 1 decode row, padded up to the widest shapes
    compiles = engine.background_compiles
    assert compiles is not None and compiles.stats["waits"] == 0 and compiles.stats["claimed"] == 0
    assert all(compiles.compiled(s) for s in order[:3])
    if not compiles.pending:  # every shape compiled (stop cancels the queued ones): calls take their own
        assert engine.fit_rows(1) == engine.min_decode_rows and engine.fit_blocks(1, 16) == 8


def test_the_default_thread_count_can_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_jax.inference.paged_shapes import COMPILE_THREADS_ENV, PagedShapes

    monkeypatch.setenv(COMPILE_THREADS_ENV, "3")
    assert PagedShapes.default_compile_threads() == 3
    monkeypatch.setenv(COMPILE_THREADS_ENV, "many")
    with pytest.raises(ValueError, match=COMPILE_THREADS_ENV):
        PagedShapes.default_compile_threads()
    monkeypatch.delenv(COMPILE_THREADS_ENV)
    assert 1 <= PagedShapes.default_compile_threads() <= 8
