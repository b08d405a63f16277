"""The paged scheduler's policy, without JAX: admission by free pages under max_running_requests,
context_length per request, shared prompt pages for a group, retraction of the cheapest request
(re-queued at the front with its tokens, never lost), and SGLang's pool sizing."""

from __future__ import annotations

import random

import pytest

from areal_jax.inference.pages import PageAllocator
from areal_jax.inference.schedule import Request, Scheduler, kv_pool_tokens


def _req(rid: str, prompt_len: int, new: int = 8, seed: int = 0) -> Request:
    return Request(rid, tuple(range(seed, seed + prompt_len)), new)


def test_submit_checks_the_context_length_per_request() -> None:
    s = Scheduler(PageAllocator(64, 16), max_running_requests=4, context_length=100)
    with pytest.raises(ValueError, match="raise --context-length"):
        s.submit(_req("a", 100))
    with pytest.raises(ValueError, match="input_ids is empty"):
        s.submit(_req("e", 0))
    r = _req("b", 90, new=50)
    s.submit(r)
    assert r.max_new_tokens == 10  # cut to the context, as SGLang does
    tiny = Scheduler(PageAllocator(2, 16), max_running_requests=4, context_length=1000)
    with pytest.raises(ValueError, match="raise --max-total-tokens"):
        tiny.submit(_req("c", 40))


def test_admission_is_by_free_pages_and_running_requests_in_order() -> None:
    pool = PageAllocator(num_pages=10, page_size=16)
    s = Scheduler(pool, max_running_requests=2, context_length=4096, share_prompts=False)
    for i, n in enumerate([40, 100, 10, 10]):  # 3 pages, 7 pages, 1, 1 (with one token of headroom)
        s.submit(_req(str(i), n, seed=1000 * i))
    got = [a.request.rid for a in s.admit()]
    assert got == ["0", "1"] and pool.free_pages == 0  # "2" finds no page: it waits, and "3" does not overtake
    s.finish(s.running[0])
    assert [a.request.rid for a in s.admit()] == ["2"]
    assert pool.free_pages == 2 and [r.rid for r in s.waiting] == ["3"]  # max_running_requests holds "3" back


def test_a_groups_answers_share_the_prompt_pages() -> None:
    pool = PageAllocator(num_pages=64, page_size=16)
    s = Scheduler(pool, max_running_requests=16, context_length=4096)
    for i in range(8):
        s.submit(Request(f"g{i}", tuple(range(40)), 16))
    admitted = s.admit()
    assert [a.shared_tokens for a in admitted] == [0] + [32] * 7  # whole pages of the 40-token prompt
    shared = admitted[0].request.table.pages[:2]
    assert all(a.request.table.pages[:2] == shared for a in admitted)
    assert [pool.refcount(p) for p in shared] == [8, 8]
    assert pool.used_pages == 3 + 7  # the prompt's 3 pages once, the tail page of each other answer
    # A retracted answer resumes on its siblings' prompt pages and prefills only its own tokens.
    victim = admitted[5].request
    victim.output += [1, 2, 3]
    s.finish(victim)
    s.submit(victim)
    (again,) = s.admit()
    assert again.request is victim and again.shared_tokens == 32


def test_answers_sent_again_with_their_tokens_share_the_longest_common_prefix() -> None:
    """After an abort the client sends each answer again as prompt + its tokens so far: they
    share the whole pages of their longest common prefix with a running request (the prompt's,
    and an answer's own tokens where two agree), never a page past a token they differ at, nor
    the page of the owner's last token (its next decode step writes it)."""
    pool = PageAllocator(num_pages=64, page_size=4)
    s = Scheduler(pool, max_running_requests=16, context_length=4096)
    prompt = tuple(range(100, 110))  # 10 tokens: two whole pages
    first = Request("a", prompt + (1, 2, 3, 4, 5), 8)
    same_start = Request("b", prompt + (1, 2, 3, 4, 9, 9), 8)  # agrees with "a" for 14 tokens
    other = Request("c", prompt + (7,), 8)
    stranger = Request("d", tuple(range(200, 216)), 8)
    for r in (first, same_start, other, stranger):
        s.submit(r)
    admitted = {a.request.rid: a for a in s.admit()}
    assert {rid: a.shared_tokens for rid, a in admitted.items()} == {"a": 0, "b": 12, "c": 8, "d": 0}
    assert admitted["b"].source is first and admitted["c"].source in (first, same_start)
    assert same_start.table.pages[:3] == first.table.pages[:3] and other.table.pages[:2] == first.table.pages[:2]
    # an owner's last token is not shared: a request equal to it up to there shares one page fewer
    short = Request("s", tuple(range(300, 308)), 8)  # 8 tokens: its last (the 8th) not yet written
    s.submit(short)
    s.admit()
    longer = Request("t", tuple(range(300, 313)), 8)
    s.submit(longer)
    (again,) = s.admit()
    assert again.shared_tokens == 4 and again.source is short
    # new weights: a request admitted under them shares nothing computed under the old ones
    s.version = 1
    newer = Request("n", prompt + (1, 2, 3, 4, 5), 8)
    s.submit(newer)
    (fresh,) = s.admit()
    assert fresh.shared_tokens == 0 and fresh.source is None
    for r in list(s.running):
        s.finish(r)
    assert pool.used_pages == 0
    pool.check()


def test_out_of_pages_retracts_the_cheapest_request_and_keeps_its_tokens() -> None:
    pool = PageAllocator(num_pages=6, page_size=4)
    s = Scheduler(pool, max_running_requests=8, context_length=4096, share_prompts=False)
    for i in range(3):
        s.submit(_req(f"r{i}", 3, new=50, seed=100 * i))
    s.admit()
    for r, out in zip(s.running, [5, 1, 3], strict=True):
        r.output += [7] * out
    assert pool.used_pages == 3
    growth = s.grow(4)  # each needs 2 or 3 pages: 7 > 6 free + held
    assert [r.rid for r in growth.retracted] == ["r1"]  # the fewest output tokens
    assert s.waiting[0].rid == "r1" and s.waiting[0].output == [7] and s.waiting[0].table is None
    assert s.waiting[0].retractions == 1
    assert all(r.table.num_tokens >= r.length + 4 for r in s.running)


def test_a_request_alone_that_outgrows_the_pool_is_cut_not_hung() -> None:
    pool = PageAllocator(num_pages=2, page_size=4)
    s = Scheduler(pool, max_running_requests=2, context_length=4096)
    s.submit(_req("a", 6, new=100))
    s.admit()
    s.running[0].output += [1, 1]
    growth = s.grow(4)
    assert growth.cut == s.running and not growth.retracted


def test_random_traffic_finishes_every_request_once_and_frees_every_page() -> None:
    """Groups of answers of random lengths through a small pool, with aborts and pauses: every
    request not aborted ends with all its tokens, exactly once; the pool never holds a page no
    running request holds; at the end no page is held."""
    rng = random.Random(0)
    pool = PageAllocator(num_pages=40, page_size=4)
    s = Scheduler(pool, max_running_requests=12, context_length=96, headroom=4)
    expected, finished, aborted = {}, {}, set()
    for g in range(120):
        prompt = tuple(rng.randrange(100) for _ in range(rng.randrange(1, 30)))
        for i in range(rng.randrange(1, 5)):
            r = Request(f"{g}.{i}", prompt, rng.randrange(1, 60))
            s.submit(r)
            expected[r.rid] = r.max_new_tokens
    rounds = retractions = 0
    while s.waiting or s.running:
        rounds += 1
        assert rounds < 20_000, "the scheduler stopped making progress"
        s.admit()
        assert len(s.running) <= 12
        growth = s.grow(4)
        retractions += len(growth.retracted)
        for r in growth.cut:
            pytest.fail(f"{r.rid} was cut: the pool holds any one request here")
        for r in list(s.running):
            r.output += [0] * min(4, r.max_new_tokens - len(r.output))
            assert r.table.num_tokens >= r.length
            if r.done:
                s.finish(r)
                assert r.rid not in finished
                finished[r.rid] = len(r.output)
        if rng.random() < 0.05 and s.running:
            victim = rng.choice(s.running)
            s.finish(victim)
            aborted.add(victim.rid)
        if rng.random() < 0.02:
            s.retract_all()
        held = {p for r in s.running for p in r.table.pages}
        assert pool.used_pages == len(held)
        pool.check()
    assert {k: v for k, v in expected.items() if k not in aborted} == finished
    assert retractions > 10  # the pool is small enough that retraction is exercised
    assert pool.used_pages == 0


def test_kv_pool_tokens_has_sglangs_meaning() -> None:
    gib = 1 << 30
    # 80 GiB device, 60 GiB free after the weights, 0.9 static: 60 - 8 = 52 GiB for KV.
    tokens = kv_pool_tokens(page_size=16, bytes_per_token=1 << 20, mem_fraction_static=0.9, device_bytes=80 * gib,
                            free_bytes=60 * gib)
    assert tokens == 52 * 1024
    assert kv_pool_tokens(page_size=16, bytes_per_token=1 << 20, mem_fraction_static=0.9, device_bytes=80 * gib,
                          free_bytes=60 * gib, max_total_tokens=1000) == 992  # capped, then whole pages
    assert kv_pool_tokens(page_size=16, bytes_per_token=1, max_total_tokens=16384) == 16384
    with pytest.raises(ValueError, match="raise --mem-fraction-static"):
        kv_pool_tokens(page_size=16, bytes_per_token=1 << 20, mem_fraction_static=0.5, device_bytes=80 * gib,
                       free_bytes=30 * gib)
    with pytest.raises(ValueError, match="give --max-total-tokens"):
        kv_pool_tokens(page_size=16, bytes_per_token=1, mem_fraction_static=0.8)


def _written(r: Request) -> Request:
    r.written = r.length - 1  # what an engine has written once a request waits to decode its next token
    return r


def test_a_request_that_left_leaves_its_written_pages_for_the_next_with_that_prefix() -> None:
    """An agent's second turn (the first turn's prompt and answer, then more) reads the first
    turn's pages from the prefix cache after the first has finished, and prefills only the rest."""
    pool = PageAllocator(num_pages=32, page_size=4)
    s = Scheduler(pool, max_running_requests=4, context_length=4096)
    first = Request("turn1", tuple(range(100, 110)), 8)
    s.submit(first)
    s.admit()
    first.output += [1, 2, 3, 4, 5, 6]  # 16 tokens: the first 15 written, so 3 whole pages
    s.grow(1)
    _written(first)
    pages = list(first.table.pages)
    s.finish(first)
    assert s.cached_pages == 3 and pool.used_pages == 3 and [pool.refcount(p) for p in pages[:3]] == [1, 1, 1]
    second = Request("turn2", first.tokens + (42, 43), 8)
    s.submit(second)
    (adm,) = s.admit()
    assert adm.shared_tokens == 12 and adm.source is None  # written already: nothing to wait for
    assert second.table.pages[:3] == pages[:3] and second.table.shared == 3
    assert [pool.refcount(p) for p in pages[:3]] == [2, 2, 2]
    # a request that agrees for two pages only reads two; one that wrote nothing leaves nothing
    other = Request("other", tuple(range(100, 108)) + (7, 7, 7, 7, 7), 8)
    s.submit(other)
    (adm,) = s.admit()
    assert adm.shared_tokens == 8
    s.finish(other)  # written = 0: its own third page goes back to the pool
    assert s.cached_pages == 3
    s.cache.check()
    pool.check()


def test_cached_pages_are_evicted_least_recently_used_first_and_never_under_a_reader() -> None:
    pool = PageAllocator(num_pages=8, page_size=4)
    s = Scheduler(pool, max_running_requests=4, context_length=4096)
    olds = []
    for k in range(3):  # three finished requests of 2 whole written pages each: 6 cached pages
        r = Request(f"old{k}", tuple(range(100 * k, 100 * k + 9)), 4)
        s.submit(r)
        s.admit()
        _written(r)
        olds.append(list(r.table.pages[:2]))
        s.finish(r)
    assert s.cached_pages == 6 and pool.free_pages == 2
    # old0 is read again (most recently used now), and held by a running reader
    reader = Request("reader", tuple(range(0, 9)) + (5,), 4)
    s.submit(reader)
    (adm,) = s.admit()
    assert adm.shared_tokens == 8 and pool.free_pages == 1  # its own third page
    # a request of 5 pages (18 tokens + headroom) needs 4 more than are free: old1's and old2's
    # pages go, least recently used first (old1 before old2), never old0's, which the reader holds
    big = Request("big", tuple(range(500, 518)), 4)
    s.submit(big)
    (adm,) = s.admit()
    assert adm.request is big and s.cache.stats["evicted_pages"] == 4
    assert set(olds[0]) <= s.cache.held() and not (set(olds[1]) | set(olds[2])) & s.cache.held()
    s.cache.check()
    pool.check()


def test_new_weights_drop_the_cache_and_running_requests_leave_nothing_in_it() -> None:
    pool = PageAllocator(num_pages=16, page_size=4)
    s = Scheduler(pool, max_running_requests=4, context_length=4096)
    done, running = Request("done", tuple(range(9)), 4), Request("running", tuple(range(50, 59)), 4)
    for r in (done, running):
        s.submit(r)
    s.admit()
    _written(done), _written(running)
    s.finish(done)
    assert s.cached_pages == 2
    s.weights_changed()
    assert s.cached_pages == 0 and pool.used_pages == len(running.table.pages)
    s.finish(running)  # its keys and values mix two weights' versions: not cached
    assert s.cached_pages == 0 and pool.used_pages == 0
    # a drop keeps what running readers hold and frees the rest
    again = Request("again", tuple(range(9)), 4)
    s.submit(again)
    s.admit()
    _written(again)
    s.finish(again)
    reader = Request("reader", tuple(range(9)) + (1,), 4)
    s.submit(reader)
    s.admit()
    assert s.drop_cache() == 2 and pool.used_pages == len(reader.table.pages)
    off = Scheduler(PageAllocator(num_pages=16, page_size=4), max_running_requests=4, context_length=4096,
                    share_prompts=False)
    r = Request("r", tuple(range(9)), 4)
    off.submit(r)
    off.admit()
    _written(r)
    off.finish(r)
    assert off.cache is None and off.allocator.used_pages == 0  # --disable-radix-cache: nothing kept


def test_random_traffic_with_the_prefix_cache_reads_only_pages_that_hold_its_tokens() -> None:
    """Agent-like traffic (turns that continue earlier answers, groups, aborts, retractions,
    pauses, weight changes) through a small pool, simulating what the device writes: every page a
    request reads from the cache holds exactly the keys of its own prefix, every request ends
    once with all its tokens, and the pool's counts always match the tables and the cache."""
    rng = random.Random(1)
    size = 4
    pool = PageAllocator(num_pages=48, page_size=size)
    s = Scheduler(pool, max_running_requests=10, context_length=160, headroom=4)
    content: dict[tuple[int, int], tuple[int, ...]] = {}  # (page, offset) -> the prefix its key was computed from
    weights = 0
    written_under: dict[int, int] = {}  # page -> the weights its keys were computed with
    history: list[tuple[int, ...]] = []
    expected, finished, hits = {}, {}, 0
    for g in range(150):
        if history and rng.random() < 0.5:  # a next turn: an earlier request's tokens, then more
            prompt = rng.choice(history) + tuple(rng.randrange(100) for _ in range(rng.randrange(1, 8)))
        else:
            prompt = tuple(rng.randrange(100) for _ in range(rng.randrange(1, 30)))
        prompt = prompt[-100:]
        for i in range(rng.randrange(1, 4)):
            r = Request(f"{g}.{i}", prompt, rng.randrange(1, 40))
            s.submit(r)
            expected[r.rid] = r.max_new_tokens
    rounds = 0
    while s.waiting or s.running:
        rounds += 1
        assert rounds < 20_000, "the scheduler stopped making progress"
        for adm in s.admit():
            r = adm.request
            r.written = 0
            if adm.source is None and adm.shared_tokens:
                hits += 1
                for pos in range(adm.shared_tokens):
                    page = r.table.pages[pos // size]
                    assert content[page, pos % size] == r.tokens[:pos + 1], "a cached page holds other tokens"
                    assert written_under[page] == weights, "a cached page holds old weights' keys"
        s.grow(4)
        for r in list(s.running):  # the device writes every token but the last, then samples
            tokens = r.tokens
            own = r.table.shared * size
            for pos in range(own, r.length - 1):
                page = r.table.pages[pos // size]
                content[page, pos % size], written_under[page] = tokens[:pos + 1], weights
            ok = all(content.get((r.table.pages[pos // size], pos % size)) == tokens[:pos + 1]
                     for pos in range(own))
            r.written = r.length - 1 if ok else 0
            r.output += [rng.randrange(100) for _ in range(min(4, r.max_new_tokens - len(r.output)))]
            if r.done:
                s.finish(r)
                assert r.rid not in finished
                finished[r.rid] = len(r.output)
                history.append(r.tokens)
        if rng.random() < 0.03 and s.running:
            victim = rng.choice(s.running)
            s.finish(victim)
            expected.pop(victim.rid)
        if rng.random() < 0.02:
            s.retract_all()
        if rng.random() < 0.04:
            weights += 1
            s.version += 1
            s.weights_changed()
        held = {p for r in s.running for p in r.table.pages}
        assert pool.used_pages == len(held | s.cache.held())
        s.cache.check()
        pool.check()
    assert expected == finished
    assert hits > 20 and s.cache.stats["evicted_pages"] > 0  # the cache is read and is evicted from
    s.drop_cache()
    assert pool.used_pages == 0
