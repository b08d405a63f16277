"""The host arrays of the paged engine's device calls (``inference.paged``): which tokens of which
requests a call computes, where their keys and values go, the ragged work lists they read through,
and the tokens a call sampled back into the requests. A mixin of ``PagedEngine``; NumPy only.

Every shape is padded so the compiled shapes are few and known at warm-up: decode rows to powers
of two (a mixed step to every running row), prefill as blocks of a fixed width (``PREFILL_BLOCK``
tokens, ``LONG_BLOCK`` behind a long chunk) packed from as many requests as the call's budget
holds, their count padded to one of a few (``PagedShapes.block_counts``), and work lists to a fixed
length per call shape with their live count (``_fixed_work``), so neither the pages the requests
hold nor how their tokens split into requests ever makes a new shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.inference.engine import _SamplingRows, _Seq
from areal_jax.inference.pages import SINK_PAGE, paged_work
from areal_jax.models.paged import work_sizes

if TYPE_CHECKING:
    from areal_jax.inference.paged import PagedEngine

PREFILL_BLOCK = 16
"""Tokens in a prefill block, the row of a prefill call: a request's tokens fill as many as they need."""
LONG_BLOCK = 128
"""Tokens in a prefill block of a call whose oldest request has ``LONG_TAKE`` or more to prefill:
the same arithmetic as narrow blocks, an eighth of the work entries to gather (a 4,000-token
prompt prefilled 1.3x faster than in 16-token blocks)."""
LONG_TAKE = 512
MIN_WIDTH = PREFILL_BLOCK
"""Narrowest prefill row (tokens)."""
MIN_WORK = 32
"""Shortest padded work list (pages read in one call): below it a call costs about the same."""
MIN_DECODE_ROWS = 8
"""Fewest padded rows of a decode call: fewer cost about the same, and each count is a shape."""


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


class PagedBatches:
    """The host side of ``PagedEngine``'s calls (see the module docstring)."""

    def _fixed_work(self: PagedEngine, tables: list[list[int]], lens: list[int], rows: int) -> tuple[np.ndarray, ...]:
        """The work list of rows that read ``lens[i]`` tokens of pages ``tables[i]``, at the fixed
        length of a call of ``rows`` rows, each reading at most a full context of pages
        (``row_pages``), with its live count: the step reads the shortest of ``work_sizes`` that
        holds it (``models.paged.attend_work``), so how many pages the requests hold never changes
        a compiled shape. Built once at that length (no second padding)."""
        size = self.allocator.page_size
        live = sum(-(-n // size) for n in lens)
        cap = max(rows * self.row_pages, live)
        self.stats["work_entries"] += live
        self.stats["work_padded_entries"] += next(n for n in work_sizes(cap) if n >= live)
        return (*paged_work(tables, lens, size, size=cap), np.int32(live))

    def _prefill_rows(self: PagedEngine, seqs: list[_Seq]) -> tuple[list[tuple[_Seq, int, int]], tuple[Any, ...]]:
        """The next tokens of ``seqs`` to prefill (all but each one's last), up to
        ``chunked_prefill_size`` in all, oldest first, packed as blocks of ``PREFILL_BLOCK`` tokens
        (``LONG_BLOCK`` behind a long chunk at the head): a block is a row of the call, a request
        takes as many as its tokens fill, and each block attends through its own pages up to its
        last token (so a short request pads by less than a block, not to the widest request, and
        a block skips the pages causality hides from it). The call's blocks are padded to the
        smallest of ``block_counts`` that holds them (padding blocks compute nothing: position
        -1, writes to the sink page, no work entries).
        A request whose shared pages another writes (``seq.source``) joins only behind that
        writer's rows, when it writes them in this same call (every token's keys and values are
        written before any row attends), so a group's answers prefill in one call with their prompt.
        Returns the rows ``(seq, start, take)`` and the arrays ids, positions, write pages and
        offsets ``[blocks, width]`` and the work list (``_fixed_work``)."""
        chunk = self.cfg.chunked_prefill_size
        budget = self.max_seq_len if chunk == -1 else chunk
        head = min(seqs[0].length - 1 - seqs[0].computed, budget) if seqs else 0
        width = LONG_BLOCK if head >= LONG_TAKE else PREFILL_BLOCK
        counts = self.block_counts(width)
        room = counts[-1]
        rows: list[tuple[_Seq, int, int]] = []
        planned: dict[int, int] = {}  # id(seq) -> its tokens written once this call has run
        blocks = 0
        for seq in seqs:
            if seq.source is not None and planned.get(id(seq.source.seq), -1) < seq.shared:
                continue  # its shared pages are written by a later call (or by its writer's row here)
            take = min(seq.length - 1 - seq.computed, budget, (room - blocks) * width)
            if take <= 0:
                if budget <= 0 or blocks >= room:
                    break
                continue
            rows.append((seq, seq.computed, take))
            planned[id(seq)] = seq.computed + take
            blocks += -(-take // width)
            budget -= take
        num_blocks = self.fit_blocks(blocks, width)  # a count of ``counts``
        ids, pos = np.zeros((num_blocks, width), np.int32), np.full((num_blocks, width), -1, np.int32)
        wp, wo = np.full((num_blocks, width), SINK_PAGE, np.int32), np.zeros((num_blocks, width), np.int32)
        tables, lens = [], []
        b = 0
        for seq, start, take in rows:
            tokens = (seq.req.input_ids + seq.out_ids)[start:start + take]
            pages, offsets = seq.sched.table.write_slots(start, start + take)
            for lo in range(0, take, width):
                n = min(width, take - lo)
                ids[b, :n] = tokens[lo:lo + n]
                pos[b, :n] = np.arange(start + lo, start + lo + n)
                wp[b, :n], wo[b, :n] = pages[lo:lo + n], offsets[lo:lo + n]
                tables.append(seq.sched.table.pages)
                lens.append(start + lo + n)
                b += 1
        self.stats["prefill_padded_tokens"] += num_blocks * width
        self.stats["prefill_tokens"] += sum(take for _, _, take in rows)
        return rows, (ids, pos, wp, wo, self._fixed_work(tables, lens, num_blocks))

    def _prefilled(self: PagedEngine, rows: list[tuple[_Seq, int, int]]) -> None:
        """A call wrote ``rows``' tokens (``_prefill_rows``): advance each request not aborted,
        retracted or resumed meanwhile."""
        for seq, start, take in rows:
            if seq.finish_reason is None and seq.sched.table is not None and seq.computed == start:
                seq.computed = start + take
                # a chunk: a call that wrote part of a request's tokens, the rest left for later ones
                self.stats["prefill_chunks"] += seq.computed < seq.length - 1

    def _decode_rows(self: PagedEngine, seqs: list[_Seq], n: int, num_rows: int | None = None) -> tuple[Any, ...]:
        """The host arrays of up to ``n`` decode tokens of each of ``seqs`` (rows padded to
        ``num_rows``, by default a power of two, ``fit_rows``): tokens, positions, PRNG steps, token counts,
        write pages and offsets ``[rows, n]``, sampling rows and the work list (``_fixed_work``)."""
        num_rows = num_rows or self.fit_rows(len(seqs))
        tokens, positions = np.zeros((num_rows,), np.int32), np.full((num_rows,), -1, np.int32)
        step, count = np.zeros((num_rows,), np.int32), np.zeros((num_rows,), np.int32)
        wp, wo = np.full((num_rows, n), SINK_PAGE, np.int32), np.zeros((num_rows, n), np.int32)
        params = _SamplingRows(num_rows)
        tables, lens = [], []
        for i, seq in enumerate(seqs):
            length = seq.length
            tokens[i] = seq.out_ids[-1] if seq.out_ids else seq.req.input_ids[-1]
            positions[i], step[i] = length - 1, len(seq.out_ids)
            params.fill(i, seq, self, sampled_here=False)
            c = count[i] = min(n, int(params.remaining[i]))
            wp[i, :c], wo[i, :c] = seq.sched.table.write_slots(length - 1, length - 1 + c)
            tables.append(seq.sched.table.pages)
            lens.append(length - 1 + c)
        work = self._fixed_work(tables, lens, num_rows)
        self.stats["decode_rows"] += len(seqs)
        self.stats["decode_padded_rows"] += num_rows
        return tokens, positions, step, count, wp, wo, params, work

    def _take_tokens(self: PagedEngine, seqs: list[_Seq], count: np.ndarray, version: int, main: np.ndarray,
                     top_values: np.ndarray, top_ids: np.ndarray, steps: Any) -> None:
        """Append the tokens a call sampled (``main [2, steps, rows]``: ids and logprobs) to
        ``seqs``, stamped ``version``; a request aborted or retracted meanwhile takes none."""
        steps = int(steps)
        self.stats["decode_steps"] += steps
        toks, logprobs = main[0].astype(np.int64).tolist(), main[1].tolist()
        for i, seq in enumerate(seqs):
            if seq.finish_reason is not None or seq.sched.table is None:  # aborted meanwhile
                continue
            for j in range(min(steps, int(count[i]))):
                self.stats["decode_tokens"] += 1
                seq.computed += 1
                if self._append(seq, toks[j][i], logprobs[j][i], version, top_values[j, i], top_ids[j, i]):
                    break
            self._notify(seq)
