"""The paged pieces together, before the engine adopts them: a greedy generation loop driven by
the scheduler's policy over ``Decoder.decode_paged``, in a pool small enough that answers are
retracted and resumed and a group's answers share their prompt pages. Every answer equals greedy
decoding by the full forward pass, so no retraction loses or corrupts a token, and no page is left
held at the end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from areal_jax.inference.pages import PageAllocator, paged_batch
from areal_jax.inference.schedule import Request, Scheduler
from areal_jax.models.attention import PagedWork
from areal_jax.models.decoder import Decoder
from tests.inference.reference import prompts, reference_greedy


@jax.jit
def _step(model: Decoder, ids, positions, cache, write_pages, write_offsets, work):
    logits, cache = model.decode_paged(ids, positions, cache, write_pages=write_pages, write_offsets=write_offsets,
                                       work=PagedWork(*work))
    return jnp.argmax(logits, axis=-1), cache


ROWS = 8  # the scheduler's max_running_requests: no call has more rows


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _call(model: Decoder, cache, rows: list[tuple[Request, int]]):
    """One paged call: row ``(req, start)`` computes tokens ``start ..`` of ``prompt + output``
    and returns the greedy token after its last one. Rows padded to ``ROWS``, tokens to a power of
    two, so the loop compiles a handful of shapes."""
    width = _pow2(max(r.length - start for r, start in rows))
    batch = paged_batch([(r.table, (r.prompt + tuple(r.output))[start:], start) for r, start in rows], ROWS, width,
                        stride=64)
    next_ids, cache = _step(model, jnp.asarray(batch.ids), jnp.asarray(batch.positions), cache,
                            jnp.asarray(batch.write_pages), jnp.asarray(batch.write_offsets),
                            tuple(map(jnp.asarray, batch.work)))
    return [int(next_ids[i, j]) for i, j in enumerate(batch.last[:len(rows)])], cache


@pytest.mark.slow
def test_greedy_loop_with_retractions_and_shared_prompts_matches_the_full_forward(model: Decoder) -> None:
    page = 4
    pool = PageAllocator(num_pages=24, page_size=page)  # 96 tokens for 12 answers of up to 34
    sched = Scheduler(pool, max_running_requests=ROWS, context_length=64, headroom=1)
    cache = model.init_paged_cache(pool.num_pages, page)
    groups = prompts([9, 14, 5], seed=3)
    requests = []
    for g, prompt in enumerate(groups):
        for i in range(4):
            r = Request(f"{g}.{i}", tuple(prompt), 20)
            sched.submit(r)
            requests.append(r)
    shared_seen = retracted = rounds = 0
    while sched.waiting or sched.running:
        rounds += 1
        assert rounds < 500
        admitted = sched.admit()
        if admitted:  # one prefill call for every admission, each from its first token not shared
            shared_seen += sum(a.shared_tokens > 0 for a in admitted)
            nxt, cache = _call(model, cache, [(a.request, a.shared_tokens) for a in admitted])
            for a, tok in zip(admitted, nxt, strict=True):
                a.request.output.append(tok)
        for r in [r for r in sched.running if r.done]:
            sched.finish(r)
        growth = sched.grow(1)
        assert not growth.cut
        retracted += len(growth.retracted)
        if sched.running:  # one decode token per running answer: its last token goes in at length - 1
            rows = [(r, r.length - 1) for r in sched.running]
            nxt, cache = _call(model, cache, rows)
            for (r, _), tok in zip(rows, nxt, strict=True):
                r.output.append(tok)
        for r in [r for r in sched.running if r.done]:
            sched.finish(r)
    assert retracted > 0 and shared_seen > 0  # both paths were exercised
    assert pool.used_pages == 0
    for r in requests:
        assert r.output == reference_greedy(model, list(r.prompt), 20), r.rid
