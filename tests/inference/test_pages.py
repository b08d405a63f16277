"""The KV page allocator and page tables: all-or-nothing allocation, refcounted sharing, read-only
shared pages, and no page leaked or double-freed over long random runs of requests, group forks,
growth, aborts, retractions and pauses (checked against an independent count of holders)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_jax.inference.pages import SINK_PAGE, OutOfPages, PageAllocator, PageTable, paged_batch, work_size


def test_alloc_is_all_or_nothing_and_never_hands_out_the_sink() -> None:
    pool = PageAllocator(num_pages=4, page_size=16)
    assert pool.max_total_tokens == 64
    got = pool.alloc(3)
    assert SINK_PAGE not in got and len(set(got)) == 3 and pool.free_pages == 1
    with pytest.raises(OutOfPages, match="needed 2 free KV pages, 1 free"):
        pool.alloc(2)
    assert pool.free_pages == 1  # the failed call took nothing
    pool.release(got)
    assert pool.free_pages == 4 and sorted(pool.alloc(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="released more often"):
        pool.release([SINK_PAGE])


def test_table_reserves_pages_at_page_boundaries() -> None:
    pool = PageAllocator(num_pages=8, page_size=4)
    t = PageTable(pool)
    t.reserve(4)
    assert len(t.pages) == 1
    t.reserve(5)  # one token past the boundary takes a second page
    assert len(t.pages) == 2 and t.pages_needed(9) == 1 and t.pages_needed(8) == 0
    pages, offsets = t.write_slots(2, 5)
    assert pages.tolist() == [t.pages[0], t.pages[0], t.pages[1]] and offsets.tolist() == [2, 3, 0]
    with pytest.raises(ValueError, match="not reserved"):
        t.write_slots(4, 6)
    t.truncate(4)
    assert len(t.pages) == 1 and pool.used_pages == 1
    t.release()
    assert pool.used_pages == 0 and t.num_tokens == 0


def test_fork_shares_whole_prompt_pages_read_only() -> None:
    pool = PageAllocator(num_pages=8, page_size=4)
    prompt = PageTable(pool)
    prompt.reserve(10)  # pages: full, full, 2 of 4
    answers = [prompt.fork(10) for _ in range(3)]
    for a in answers:
        assert a.pages == prompt.pages[:2] and a.num_tokens == 8
    assert [pool.refcount(p) for p in prompt.pages] == [4, 4, 1]
    with pytest.raises(ValueError, match="shared pages are read-only"):
        answers[0].write_slots(7, 8)
    answers[0].reserve(11)  # the answer writes the prompt's last two tokens and its own in its own page
    pages, _ = answers[0].write_slots(8, 11)
    assert set(pages.tolist()) == {answers[0].pages[2]} and answers[0].pages[2] not in prompt.pages
    prompt.release()  # the prompt request finishes first: its shared pages stay with the answers
    assert [pool.refcount(p) for p in answers[1].pages] == [3, 3]
    for a in answers:
        a.release()
    assert pool.used_pages == 0
    pool.check()


def _holders_agree(pool: PageAllocator, tables: list[PageTable]) -> None:
    held = Counter(p for t in tables for p in t.pages)
    for page in range(1, pool.num_pages + 1):
        assert pool.refcount(page) == held[page], page
    assert pool.used_pages == len(held)
    pool.check()


def _simulate(ops: list[tuple[str, int]], pool: PageAllocator, check_every: int) -> int:
    """Run ``ops`` as a scheduler would: ``arrive`` (a group of n answers forking one prompt),
    ``grow`` a running answer by some tokens (on ``OutOfPages`` the youngest answer is retracted:
    its pages freed, the answer re-queued with its tokens), ``abort`` / ``finish`` one, ``pause``
    (retract all, then resume each whose pages fit). Returns the retractions seen."""
    running: list[PageTable] = []
    queued: list[int] = []  # token counts of retracted answers, to be resumed
    retracted = 0

    def admit(tokens: int) -> bool:
        t = PageTable(pool)
        try:
            t.reserve(tokens)
        except OutOfPages:
            return False
        running.append(t)
        return True

    for i, (op, arg) in enumerate(ops):
        if op == "arrive":
            prompt = PageTable(pool)
            try:
                prompt.reserve(1 + arg % 37)
            except OutOfPages:
                queued.append(1 + arg % 37)
                continue
            for _ in range(1 + arg % 4):
                running.append(prompt.fork(prompt.num_tokens))
            prompt.release()  # the prompt's own table goes; its whole pages live on in the answers
        elif op == "grow" and running:
            t = running[arg % len(running)]
            try:
                t.reserve(t.num_tokens + 1 + arg % 9)
            except OutOfPages:
                victim = running.pop()  # retract, never lose: its token count goes back in the queue
                queued.append(victim.num_tokens)
                victim.release()
                retracted += 1
        elif op in ("abort", "finish") and running:
            running.pop(arg % len(running)).release()
        elif op == "pause":
            for t in running:
                queued.append(t.num_tokens)
                t.release()
            running.clear()
        if op in ("pause", "finish", "abort") and queued:
            queued = [n for n in queued if not admit(n)]
        if i % check_every == 0:
            _holders_agree(pool, running)
    _holders_agree(pool, running)
    for t in running:
        t.release()
    assert pool.used_pages == 0 and pool.free_pages == pool.num_pages
    pool.check()
    return retracted


OPS = ("arrive", "grow", "grow", "grow", "abort", "finish", "pause")


def test_ten_thousand_random_requests_leave_no_page_held() -> None:
    rng = random.Random(0)
    ops = [(rng.choice(OPS), rng.randrange(1000)) for _ in range(10_000)]
    pool = PageAllocator(num_pages=48, page_size=4)
    retracted = _simulate(ops, pool, check_every=50)
    assert retracted > 100  # the pool is small enough that retraction is exercised, not just admission


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 999)), max_size=120),
       num_pages=st.integers(1, 24), page_size=st.sampled_from([1, 2, 4, 16]))
def test_any_sequence_of_operations_leaves_no_page_held(ops: list[tuple[str, int]], num_pages: int,
                                                       page_size: int) -> None:
    _simulate(ops, PageAllocator(num_pages, page_size), check_every=1)


def test_work_size_pads_to_few_shapes_with_bounded_waste() -> None:
    assert [work_size(n) for n in (0, 1, 3, 100, 128, 129, 692, 768)] == [1, 1, 4, 128, 128, 256, 768, 768]
    sizes = {work_size(n) for n in range(1, 2049)}
    assert len(sizes) == 8 + 2048 // 128 - 1  # 1 .. 128, then 256 .. 2048
    assert all(work_size(n) < n + 128 for n in range(129, 2049))


def test_paged_batch_places_each_rows_tokens_in_its_pages() -> None:
    pool = PageAllocator(num_pages=8, page_size=4)
    a, b = PageTable(pool), PageTable(pool)
    a.reserve(6)
    b.reserve(1)
    batch = paged_batch([(a, [7, 8], 4), (b, [9], 0)], num_rows=4, width=2)
    assert batch.ids.tolist() == [[7, 8], [9, 0], [0, 0], [0, 0]]
    assert batch.positions.tolist() == [[4, 5], [0, -1], [-1, -1], [-1, -1]]
    assert batch.write_pages.tolist() == [[a.pages[1]] * 2, [b.pages[0], SINK_PAGE], [SINK_PAGE] * 2, [SINK_PAGE] * 2]
    assert batch.write_offsets[0].tolist() == [0, 1] and batch.last[:2].tolist() == [1, 0]
    rows, pages, first = batch.work
    assert rows.tolist() == [0, 0, 1, 1] and pages.tolist()[:3] == [*a.pages, *b.pages]
    assert first.tolist()[:3] == [0, 4, 0]
    with pytest.raises(ValueError, match="1 to width=2"):
        paged_batch([(a, [1, 2, 3], 3)], num_rows=1, width=2)
    with pytest.raises(ValueError, match="not reserved"):
        paged_batch([(b, [1, 2], 1)], num_rows=1, width=2)
