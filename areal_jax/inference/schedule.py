"""The paged engine's scheduling policy: which waiting requests enter, which prompt pages they
share, and which running requests are retracted when the KV pool runs out.

Pure Python over ``inference.pages`` (no JAX), so the policy is tested on its own; an engine turns
its decisions into device calls (prefill ``Admission.request`` from ``Admission.shared_tokens``,
decode the running requests, write where their page tables say). SGLang's meanings:

- ``max_running_requests`` bounds the requests decoding at once; the KV pool (its
  ``max_total_num_tokens``) bounds their tokens, and admission is by free pages, not free slots.
- ``context_length`` bounds one request (prompt + answer): a longer prompt is refused, a longer
  ``max_new_tokens`` is cut to fit.
- When a decode step needs pages the pool does not have, running requests are retracted: their
  pages are freed and they go back to the front of the queue with every token they have, to be
  prefilled again later (never lost). The victim is the request with the fewest output tokens
  (the least work lost), the longest prompt among equals, as SGLang's ``retract_decode`` picks.
- Requests that begin with the same tokens share the whole pages of that prefix with a running
  request that holds them: a GRPO group's answers (one prompt), an answer resumed after a
  retraction while its siblings run, and the answers a client sends again after a weight update
  aborted them (prompt plus each one's tokens so far: the group's prompt is their common prefix).
  One copy, n readers, and each reader prefills only the tokens past the shared pages
  (``share_prompts``; ``--disable-radix-cache`` turns it off). Candidates are found by their
  first page of tokens; the longest common prefix wins.
- Requests that leave the pool (finished, aborted, retracted) leave the whole pages of their
  written tokens in a prefix cache (``inference.prefix_cache``, SGLang's radix cache), which a
  later request beginning with the same tokens reads: an agent's next turn, a resumed answer.
  Cached pages are evicted, least recently used first, whenever an allocation finds the pool
  short, so they cost no capacity; the cache is cleared whenever the weights change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from areal_jax.inference.pages import OutOfPages, PageAllocator, PageTable
from areal_jax.inference.prefix_cache import PrefixCache


@dataclass(eq=False)
class Request:
    """The scheduler's view of one request: its tokens and its pages."""

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    table: PageTable | None = None
    """Its pages while running; None while waiting."""
    retractions: int = 0
    key: tuple[int, ...] = ()
    """Its first page of tokens when it was admitted: where the scheduler files it as a prefix owner."""
    version: int | None = 0
    """The weight version it was admitted under: only requests of the same version share pages
    (None once the weights changed while it ran: its pages mix two versions' keys and values)."""
    written: int = 0
    """Tokens of ``tokens`` whose keys and values are written in its pages, where nothing derives
    it (``written_tokens``; the engine's requests do): the whole pages among them go to the prefix
    cache when it leaves the pool."""

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + tuple(self.output)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens

    def written_tokens(self) -> int:
        """Tokens whose keys and values are in its pages now (``written``)."""
        return self.written


@dataclass(frozen=True)
class Admission:
    """A request let in: its KV for tokens ``0 .. shared_tokens - 1`` is already in its pages
    (another request's prompt pages); the engine prefills the rest of ``prompt + output``."""

    request: Request
    shared_tokens: int
    source: Request | None = None
    """The running request whose pages were shared (None when nothing was): until it has
    written its first ``shared_tokens`` tokens (a group admitted together), the new request
    must not read them."""


@dataclass
class Growth:
    """The outcome of reserving pages for a decode call."""

    retracted: list[Request] = field(default_factory=list)
    """Back at the front of the queue, pages freed, tokens kept."""
    cut: list[Request] = field(default_factory=list)
    """Running alone and still short of pages: the pool cannot hold them; finish them (length)."""


class Scheduler:
    """FIFO admission by free pages under ``max_running_requests``, retract-and-requeue when the
    pool runs out, shared prompt pages and a prefix cache (both off without ``share_prompts``).
    ``headroom`` tokens are reserved past a request's length at admission (its next decode call's
    tokens), so a request admitted is not retracted at once."""

    def __init__(self, allocator: PageAllocator, *, max_running_requests: int, context_length: int,
                 headroom: int = 1, share_prompts: bool = True) -> None:
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests={max_running_requests}: at least one request must run")
        if context_length < 2:
            raise ValueError(f"context_length={context_length}: a request needs a prompt token and an answer token")
        self.allocator = allocator
        self.max_running_requests, self.context_length = max_running_requests, context_length
        self.headroom, self.share_prompts = max(headroom, 1), share_prompts
        self.version = 0
        """The served weights' version (the engine sets it): a request admitted under an older one
        (its KV kept across an ``in_place`` update) lends no page to a newer one."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._readers: dict[tuple[int, ...], list[Request]] = {}
        """Running requests by their first page of tokens: where a new request finds a prefix's pages."""
        self.cache = PrefixCache(allocator) if share_prompts else None
        """Pages of requests that left the pool, for later requests with the same prefix."""

    @property
    def cached_pages(self) -> int:
        """Pages the prefix cache holds: those no running request reads are free for the taking
        when the pool runs short."""
        return 0 if self.cache is None else self.cache.pages

    def weights_changed(self) -> None:
        """The engine serves other weights from now on: keys and values computed so far are the
        old weights'. The prefix cache is dropped, and no running request lends its pages to a
        new one or leaves them in the cache."""
        for req in self.running:
            req.version = None
        if self.cache is not None:
            self.cache.clear()

    def drop_cache(self) -> int:
        """Free every page only the prefix cache holds (SGLang's ``/flush_cache``); returns the
        pages the cache dropped."""
        return 0 if self.cache is None else self.cache.clear()

    # -- requests in and out --

    def submit(self, req: Request) -> None:
        """Queue ``req`` (at the back); a prompt the context or the pool cannot hold is refused."""
        if not req.prompt:
            raise ValueError(f"request {req.rid!r}: input_ids is empty; send at least one prompt token")
        if len(req.prompt) >= self.context_length:
            raise ValueError(f"request {req.rid!r}: the prompt has {len(req.prompt)} tokens, at least the "
                             f"context_length of {self.context_length}; shorten it or raise --context-length")
        if self.allocator.pages_for(len(req.prompt) + 1) > self.allocator.num_pages:
            raise ValueError(f"request {req.rid!r}: the prompt has {len(req.prompt)} tokens, more than the KV pool's "
                             f"{self.allocator.max_total_tokens}; raise --max-total-tokens or --mem-fraction-static")
        req.max_new_tokens = min(req.max_new_tokens, self.context_length - len(req.prompt))
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """``req`` is done (or aborted): its pages go back, it leaves the queue or the running set."""
        if req.table is not None:
            self._drop_running(req)
        else:
            self.waiting.remove(req)

    def retract_all(self) -> list[Request]:
        """Every running request back to the queue's front, in admission order (a pause that
        keeps the answers: they resume with their tokens)."""
        out = list(self.running)
        for req in reversed(out):
            self._retract(req)
        return out

    # -- one scheduling round --

    def admit(self) -> list[Admission]:
        """Let waiting requests in, oldest first, while a slot under ``max_running_requests`` and
        pages for their tokens plus ``headroom`` are free; the first that does not fit stops the
        round (no overtaking: a long prompt is not starved by short ones behind it)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_running_requests:
            req = self.waiting[0]
            table, shared, source = self._shared_table(req)
            try:
                self._reserve(table, req.length + self.headroom)
            except OutOfPages:
                table.release()
                break
            self.waiting.popleft()
            req.table = table
            self.running.append(req)
            req.key, req.version = req.tokens[:self.allocator.page_size], self.version
            self._readers.setdefault(req.key, []).append(req)
            admitted.append(Admission(req, shared, source))
        return admitted

    def grow(self, tokens: int) -> Growth:
        """Reserve pages for ``tokens`` more tokens of every running request (the next decode
        call), retracting the cheapest requests when the pool is short; oldest requests are served
        first, so the work most advanced is kept."""
        out = Growth()
        for req in list(self.running):
            if req.table is None:  # retracted below to make room for an older request
                continue
            want = min(req.length + tokens, len(req.prompt) + req.max_new_tokens)
            while True:
                try:
                    self._reserve(req.table, want)
                    break
                except OutOfPages:
                    if len(self.running) == 1:
                        out.cut.append(req)
                        break
                    victim = min(self.running, key=lambda r: (len(r.output), -len(r.prompt)))
                    self._retract(victim)
                    out.retracted.append(victim)
                    if victim is req:
                        break
        return out

    # -- helpers --

    def retract(self, req: Request) -> None:
        """Send running ``req`` back to the queue's front, its pages freed and its tokens kept."""
        self._retract(req)

    def _reserve(self, table: PageTable, num_tokens: int) -> None:
        """``table.reserve``, evicting cached pages first when the pool is short."""
        try:
            table.reserve(num_tokens)
        except OutOfPages as e:
            if self.cache is None or not self.cache.evict(e.needed - e.free):
                raise
            table.reserve(num_tokens)

    def _shared_table(self, req: Request) -> tuple[PageTable, int, Request | None]:
        """A page table for ``req``: the whole pages of the longest prefix of its tokens that the
        prefix cache holds or a running request's tokens begin with (at least ``req``'s last token
        is left to compute, which samples the next; at most the owner's tokens but its last, which
        its next decode step writes), else a new empty table. The cache wins a tie: its pages are
        written already, a running owner's may not be yet."""
        if self.share_prompts:
            size = self.allocator.page_size
            tokens = req.tokens
            limit = (len(tokens) - 1) // size
            cached = self.cache.match(tokens, limit) if self.cache is not None and limit else []
            best, source = len(cached), None
            for owner in self._readers.get(tokens[:size], ()) if best < limit else ():
                if owner.version != self.version:
                    continue
                theirs = owner.tokens
                most = min(limit, (len(theirs) - 1) // size)
                whole = 0
                while whole < most and tokens[whole * size:(whole + 1) * size] == theirs[whole * size:
                                                                                         (whole + 1) * size]:
                    whole += 1
                if whole > best:
                    best, source = whole, owner
                    if best == limit:
                        break
            if source is not None:
                child = source.table.fork(best * size)
                return child, child.num_tokens, source
            if cached:
                child = PageTable(self.allocator)
                self.allocator.retain(cached)
                child.pages, child.shared, child.num_tokens = cached, len(cached), len(cached) * size
                return child, child.num_tokens, None
        return PageTable(self.allocator), 0, None

    def _drop_running(self, req: Request) -> None:
        self.running.remove(req)
        readers = self._readers[req.key]
        readers.remove(req)
        if not readers:
            del self._readers[req.key]
        whole = min(req.written_tokens(), req.table.num_tokens) // self.allocator.page_size
        if self.cache is not None and whole and req.version == self.version:
            self.cache.insert(req.tokens, req.table.pages[:whole])
        req.table.release()
        req.table = None

    def _retract(self, req: Request) -> None:
        self._drop_running(req)
        req.retractions += 1
        self.waiting.appendleft(req)


def kv_pool_tokens(*, page_size: int, bytes_per_token: int, max_total_tokens: int | None = None,
                   mem_fraction_static: float | None = None, device_bytes: int | None = None,
                   free_bytes: int | None = None) -> int:
    """The KV pool's size in tokens (SGLang's ``max_total_num_tokens``), a multiple of
    ``page_size``. With ``mem_fraction_static`` the static memory (weights and the pool) may take
    that fraction of the device's ``device_bytes``: the pool gets what is ``free_bytes`` after the
    weights less the ``1 - mem_fraction_static`` share kept back, at ``bytes_per_token`` (keys
    and values of every layer); ``max_total_tokens`` then caps it, as in SGLang. Without a
    fraction (no device memory to profile, e.g. on CPU) ``max_total_tokens`` is the size."""
    if mem_fraction_static is not None:
        if not 0 < mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={mem_fraction_static} must lie strictly between 0 and 1")
        if device_bytes is None or free_bytes is None:
            raise ValueError("mem_fraction_static needs the device's memory size and free memory; on a backend "
                             "that reports none (CPU) give --max-total-tokens instead")
        tokens = int(free_bytes - device_bytes * (1 - mem_fraction_static)) // bytes_per_token
        if max_total_tokens is not None:
            tokens = min(tokens, max_total_tokens)
    elif max_total_tokens is not None:
        tokens = max_total_tokens
    else:
        raise ValueError("size the KV pool with --max-total-tokens or --mem-fraction-static")
    tokens = tokens // page_size * page_size
    if tokens <= 0:
        raise ValueError(f"the KV pool would hold {tokens} tokens: not enough memory; raise --mem-fraction-static "
                         f"or --max-total-tokens (at least one page of {page_size})")
    return tokens
