"""Mixed steps of the paged engine: a prefill chunk and the decode tokens of every running answer
in one device call. Prompts of ragged lengths (on and beside page boundaries, several chunks long)
land while answers decode; every answer and every prompt's answer equals greedy decoding by the
full forward pass with its logprobs, and while a long prompt prefills no device call leaves a
running answer without a token (on the alternating path, the prefill calls do)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.paged import PagedEngine
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from areal_jax.models.paged import work_sizes
from tests.inference.reference import _logits, assert_no_page_leaked, prompts, reference_greedy, reference_logprobs, run

# Pages of 4 tokens, chunks of 16: a 70-token prompt prefills in 5 mixed steps.
CFG = EngineConfig(num_slots=8, max_seq_len=128, max_prefill_batch=4, decode_steps=4, seed=0, kv_cache="paged",
                   page_size=4, max_total_tokens=1024, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def paged(ckpt: Path) -> PagedEngine:
    engine = Engine(load_pretrained(ckpt), CFG)
    assert isinstance(engine, PagedEngine) and engine.mixed_chunk
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _snapshot(engine: PagedEngine, watched: list) -> dict[str, int | None]:
    """Each watched answer's token count (None once it has finished)."""
    seqs = {r.rid: engine._live.get(r.rid) for r in watched}  # noqa: SLF001
    return {rid: None if s is None or s.finish_reason is not None else len(s.out_ids) for rid, s in seqs.items()}


def _record_calls(engine: PagedEngine, watched: list, calls: list) -> None:
    """Wrap the engine's device calls: append each call's stat name, the watched answers' token
    counts when it began (``_snapshot``) and whether a prompt was still being prefilled then.
    A round appends a call's tokens after the call, so the next call's snapshot shows them."""
    timed = engine._timed  # noqa: SLF001 - every device call of a round goes through it

    async def timing(stat: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        prefilling = any(s.computed < s.length - 1 for s in engine._live.values()  # noqa: SLF001
                         if s.sched is not None and s.sched.table is not None)
        calls.append((stat, _snapshot(engine, watched), prefilling))
        return await timed(stat, fn, *args, **kwargs)

    engine._timed = timing  # noqa: SLF001


def _gains(calls: list, final: dict) -> list[tuple[str, bool, list[int]]]:
    """Per call: its stat, whether a prompt was being prefilled, and the tokens each answer
    running when it began had gained by the next call (a finished answer counts as its last)."""
    out = []
    for (stat, before, prefilling), (_, after, _) in zip(calls, [*calls[1:], (None, final, None)], strict=True):
        live = [rid for rid, n in before.items() if n is not None]
        out.append((stat, prefilling, [(after[rid] or 10**9) - before[rid] for rid in live]))
    return out


def _answers_then_prompts(engine: PagedEngine, answers: list[GenerateRequest], late: list[GenerateRequest],
                          calls: list | None = None) -> list:
    """Start ``answers``; once each has 2 tokens (they are decoding), submit ``late``."""
    async def go() -> list:
        await engine.start()
        try:
            first = [asyncio.create_task(engine.generate(r)) for r in answers]
            while not all((s := engine._live.get(r.rid)) is not None and len(s.out_ids) >= 2  # noqa: SLF001
                          for r in answers):
                # an answer that finished before it was seen decoding would leave this loop waiting forever
                # (a warm engine runs a short answer between two polls): fail instead, naming the cause
                assert not any(t.done() for t in first), "an answer finished before the late prompts arrived"
                await asyncio.sleep(0.005)
            if calls is not None:
                _record_calls(engine, answers, calls)
            second = [asyncio.create_task(engine.generate(r)) for r in late]
            return await asyncio.gather(*first, *second)
        finally:
            engine.__dict__.pop("_timed", None)
            await engine.stop()

    return run(go())


def test_prompts_landing_while_answers_decode_equal_the_reference(paged: PagedEngine, model: Decoder) -> None:
    """Four answers (64 tokens: still decoding when a warm engine has them at two) decode while
    prompts of 3, 4, 5, 8, 9, 17, 33 and 41 tokens arrive: the
    mixed steps that prefill them (ragged, beside and on page boundaries, one to three chunks)
    also decode the answers, and every token and logprob equals the full forward pass's."""
    before = dict(paged.stats)
    answers = [GenerateRequest(p, greedy(64)) for p in prompts([6, 7, 10, 12], seed=21)]
    late = [GenerateRequest(p, greedy(10)) for p in prompts([3, 4, 5, 8, 9, 17, 33, 41], seed=22)]
    outs = _answers_then_prompts(paged, answers, late)
    for r, out in zip(answers + late, outs, strict=True):
        n = r.sampling.max_new_tokens
        assert out.output_ids == reference_greedy(model, r.input_ids, n), r.input_ids
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 0),
                                   atol=1e-4)
    assert paged.stats["mixed_calls"] > before["mixed_calls"]
    assert paged.stats["prefill_chunks"] > before["prefill_chunks"]  # 17, 33 and 41 took several chunks
    assert_no_page_leaked(paged)


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed", "alternating"])
def test_a_long_prompt_does_not_stall_running_answers(paged: PagedEngine, model: Decoder, mixed: bool) -> None:
    """Six answers decode; a 70-token prompt (5 chunks of 16) arrives. With mixed steps every
    device call made while the prompt prefills gives every running answer a token or more; on the
    alternating path (``mixed_chunk = False``) the prefill calls give them none. Both paths
    compute the reference's tokens."""
    paged.mixed_chunk = mixed
    try:
        answers = [GenerateRequest(p, greedy(40)) for p in prompts([5, 6, 7, 8, 9, 10], seed=23)]
        long = GenerateRequest(prompts([70], seed=24)[0], greedy(4))
        calls: list = []
        outs = _answers_then_prompts(paged, answers, [long], calls)
    finally:
        paged.mixed_chunk = True
    during = [(stat, gained) for stat, prefilling, gained in _gains(calls, {r.rid: None for r in answers})
              if prefilling and gained]
    assert len(during) >= 5  # the prompt took at least its 5 chunks' calls
    stalled = [(stat, gained) for stat, gained in during if 0 in gained]
    if mixed:
        assert not stalled, stalled
        assert all(stat == "mixed_seconds" and min(gained) >= 1 for stat, gained in during), during
    else:
        assert len(stalled) >= 5 and all(stat == "prefill_seconds" for stat, _ in stalled)
    for r, out in zip([*answers, long], outs, strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, r.sampling.max_new_tokens)
    assert_no_page_leaked(paged)


def test_top_logprobs_and_sampled_tokens_of_answers_decoded_in_mixed_steps(paged: PagedEngine, model: Decoder) -> None:
    """Answers that ask for top logprobs, and a seeded sampled answer, decode while a 41-token
    prompt prefills (3 mixed steps, each giving the answers their first token in the chunk's
    forward pass and the rest in the call's decode loop): every token's top 3 equal the full
    forward pass's, and the sampled answer equals the same request run alone (its token ``i``
    is drawn from its own stream at step ``i`` whichever call samples it)."""
    tops = SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True, top_logprobs_num=3)
    sampled = SamplingParams(max_new_tokens=48, temperature=0.9, seed=3, ignore_eos=True)
    p_sampled = prompts([9], seed=27)[0]
    before = paged.stats["mixed_calls"]
    answers = [GenerateRequest(p, tops) for p in prompts([5, 11], seed=26)] + [GenerateRequest(p_sampled, sampled)]
    outs = _answers_then_prompts(paged, answers, [GenerateRequest(prompts([41], seed=28)[0], greedy(4))])
    assert paged.stats["mixed_calls"] >= before + 3
    for r, out in zip(answers[:2], outs, strict=False):
        ids = r.input_ids + out.output_ids
        logp = np.asarray(jax.nn.log_softmax(_logits(model, ids)[len(r.input_ids) - 1:-1], axis=-1))
        for t, top in enumerate(out.output_top_logprobs):
            want = np.argsort(-logp[t])[:3]
            assert [tok for _, tok in top] == want.tolist()
            np.testing.assert_allclose([v for v, _ in top], logp[t][want], atol=1e-4)
    (alone,) = run(_one(paged, GenerateRequest(p_sampled, sampled)))
    assert outs[2].output_ids == alone.output_ids


def test_after_warmup_a_run_crossing_page_buckets_compiles_nothing_and_leaves_no_state(paged: PagedEngine) -> None:
    """Warm-up compiles every shape a running engine calls (``step_shapes``): answers of ragged
    lengths whose pages cross several work-list sizes (powers of two and the steps between), prompts
    landing in mixed steps beside them in waves, each chunked, then decode calls of fewer rows,
    compile nothing more (counted in the jitted steps' caches, not timed). Before the work lists had
    a fixed length a mixed step's shape was the product of the decode pages' bucket and the prefill
    chunk's, and each new pair compiled mid-run. Afterwards the pool, the scheduler's tables and the
    engine's request records hold nothing."""
    engine = paged
    assert engine.warmup() == len(engine.step_shapes())
    steps = (engine.mixed_fn, engine.decode_fn, engine.prefill_fn)
    compiled = [f._cache_size() for f in steps]  # noqa: SLF001 - the count of compiled shapes
    shapes = set(engine.compiled_shapes)
    live: list[int] = []
    fixed = engine._fixed_work  # noqa: SLF001

    def record(tables: list, lens: list, rows: int) -> tuple:
        out = fixed(tables, lens, rows)
        live.append(int(out[3]))
        return out

    engine._fixed_work = record  # noqa: SLF001
    # every call's shape, as its caller names it (``PagedShapes``), beside the one its arrays have
    named: list[tuple] = []
    run_step = engine._run_step  # noqa: SLF001

    def checked(shape: tuple, fn: Any, state: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is engine.mixed_fn:
            named.append((shape, ("mixed", len(args[0]), *np.shape(args[5]), len(args[4][0]), len(args[9][0]))))
        elif fn is engine.decode_fn:
            named.append((shape, ("decode", len(args[0]), kwargs["num_steps"], len(args[4][0]))))
        return run_step(shape, fn, state, cache, *args, **kwargs)

    engine._run_step = checked  # noqa: SLF001
    waves = [[GenerateRequest(p, greedy(n)) for p, n in zip(prompts(lengths, seed=40 + i), news, strict=True)]
             for i, (lengths, news) in enumerate([([3, 21, 40], [90, 60, 30]), ([70, 9, 33, 50], [40, 20, 50, 10]),
                                                  ([5, 100], [20, 15])])]

    async def go() -> list:
        await engine.start()
        try:
            base = engine.stats["decode_tokens"]
            tasks = [asyncio.ensure_future(engine.generate(r)) for r in waves[0]]
            for wave, after in zip(waves[1:], (30, 120), strict=True):
                # the next prompts land while the answers before them decode
                while engine.stats["decode_tokens"] - base < after and not all(t.done() for t in tasks):
                    await asyncio.sleep(0.01)
                tasks += [asyncio.ensure_future(engine.generate(r)) for r in wave]
            return await asyncio.gather(*tasks)
        finally:
            await engine.stop()

    try:
        before = dict(engine.stats)
        outs = run(go())
    finally:
        del engine._fixed_work, engine._run_step  # noqa: SLF001
    assert named and all(given == built for given, built in named), [n for n in named if n[0] != n[1]]
    assert {s[0][0] for s in named} == {"mixed", "decode"}
    assert [len(o.output_ids) for o in outs] == [r.sampling.max_new_tokens for w in waves for r in w]
    assert engine.stats["mixed_calls"] > before["mixed_calls"] and engine.stats["decode_calls"] > before["decode_calls"]
    sizes = work_sizes(engine.mixed_rows * engine.row_pages)
    assert len({next(n for n in sizes if n >= x) for x in live}) >= 3, sorted(set(live))  # 32, 64, 96 pages
    assert [f._cache_size() for f in steps] == compiled  # noqa: SLF001 - not one compile during the run
    assert engine.compiled_shapes == shapes and set(engine.step_shapes()) <= shapes
    assert_no_page_leaked(engine)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting and not sched._readers  # noqa: SLF001
    assert not engine._live and engine.num_free_slots == CFG.num_slots  # noqa: SLF001


async def _one(engine: PagedEngine, req: GenerateRequest) -> list:
    await engine.start()
    try:
        return [await engine.generate(req)]
    finally:
        await engine.stop()
