"""The host arrays of the paged engine's device calls (``inference.paged``): which tokens of which
requests a call computes, where their keys and values go, the ragged work lists they read through,
and the tokens a call sampled back into the requests. A mixin of ``PagedEngine``; NumPy only.

Every shape is padded so the compiled shapes are few and known at warm-up: rows and prefill
widths to powers of two (a mixed step to every running row and the most prefill rows of its width,
``_pad_prefill``), work lists to a fixed length per call shape with their live count
(``_fixed_work``), so the pages the requests hold never make a new shape. The alternating path's
prefill calls still pad their work lists to ``work_bucket`` (compiled on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from areal_jax.inference.engine import _SamplingRows, _Seq
from areal_jax.inference.pages import NO_POSITION, SINK_PAGE, paged_work
from areal_jax.models.paged import work_sizes

if TYPE_CHECKING:
    from areal_jax.inference.paged import PagedEngine

MIN_WIDTH = 16
"""Narrowest padded prefill row (tokens)."""
MIN_WORK = 32
"""Shortest padded work list (pages read in one call): below it a call costs about the same."""
MIN_DECODE_ROWS = 8
"""Fewest padded rows of a decode call: fewer cost about the same, and each count is a shape."""


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


def work_bucket(n: int, least: int = MIN_WORK, half_steps: bool = True) -> int:
    """The padded length of a work list of ``n`` entries: the smallest of ``2**k`` and (with
    ``half_steps``) ``3 * 2**(k - 1)`` that holds it (at least ``least``). Attention costs the
    padded length, so the half steps keep the padding under a third (a long tail of 691 entries
    pads to 768, not 1,024) for twice the shapes of powers of two alone."""
    p = pow2(n, least)
    return p * 3 // 4 if half_steps and p >= 4 * least and n <= p * 3 // 4 else p


class PagedBatches:
    """The host side of ``PagedEngine``'s calls (see the module docstring)."""

    def _work(self: PagedEngine, tables: list[list[int]], lens: list[int],
              half_steps: bool = True) -> tuple[np.ndarray, ...]:
        """The work list of rows that read ``lens[i]`` tokens of pages ``tables[i]``, padded."""
        size = self.allocator.page_size
        entries = sum(-(-n // size) for n in lens)
        padded = work_bucket(entries, half_steps=half_steps)
        self.stats["work_entries"] += entries
        self.stats["work_padded_entries"] += padded
        return paged_work(tables, lens, size, size=padded)

    def _fixed_work(self: PagedEngine, work: tuple[np.ndarray, ...], rows: int) -> tuple[np.ndarray, ...]:
        """``work`` (a padded list, ``_work``) at the fixed length of a call of ``rows`` rows,
        each reading at most a full context of pages (``row_pages``), with its live count: the
        step reads the shortest of ``work_sizes`` that holds it (``models.paged.attend_work``),
        so how many pages the requests hold never changes a compiled shape."""
        cap = max(rows * self.row_pages, len(work[0]))
        live = int(np.count_nonzero(work[2] != NO_POSITION))
        read = next(n for n in work_sizes(cap) if n >= live)
        self.stats["work_padded_entries"] += read - len(work[0])  # ``_work`` counted its own padding
        out = (np.full((cap,), work[0][-1], np.int32), np.full((cap,), SINK_PAGE, np.int32),
               np.full((cap,), NO_POSITION, np.int32))
        for new, old in zip(out, work, strict=True):
            new[:len(old)] = old
        return (*out, np.int32(live))

    def _pad_prefill(self: PagedEngine, chunk: tuple[Any, ...], rows: int) -> tuple[Any, ...]:
        """A mixed step's prefill arrays (``_prefill_rows``: ids, positions, write pages and
        offsets ``[rows, width]``, work list) padded to ``rows`` rows (padding rows compute
        nothing: position -1, writes to the sink page, no work entries) and the work list to its
        fixed length (``_fixed_work``)."""
        ids, pos, wp, wo, work = chunk
        extra = rows - ids.shape[0]
        if extra > 0:
            pad = lambda a, v: np.concatenate([a, np.full((extra, a.shape[1]), v, a.dtype)])
            ids, pos, wp, wo = pad(ids, 0), pad(pos, -1), pad(wp, SINK_PAGE), pad(wo, 0)
            self.stats["prefill_padded_tokens"] += extra * ids.shape[1]
        return ids, pos, wp, wo, self._fixed_work(work, ids.shape[0])

    def _prefill_rows(self: PagedEngine, seqs: list[_Seq],
                      half_steps: bool = True) -> tuple[list[tuple[_Seq, int, int]], tuple[Any, ...]]:
        """The next tokens of ``seqs`` to prefill (all but each one's last), up to
        ``chunked_prefill_size`` in all, oldest first, one row each (padded to the widest).
        A request whose shared pages another writes (``seq.source``) joins only behind that
        writer's row, when it writes them in this same call (every token's keys and values are
        written before any row attends), so a group's answers prefill in one call with their prompt.
        Returns the rows ``(seq, start, take)`` and the arrays ids, positions (-1: padding), write
        pages and offsets ``[rows, width]`` and the work list."""
        chunk = self.cfg.chunked_prefill_size
        budget = self.max_seq_len if chunk == -1 else chunk
        rows: list[tuple[_Seq, int, int]] = []
        planned: dict[int, int] = {}  # id(seq) -> its tokens written once this call has run
        widest = real = 0
        for seq in seqs:
            if seq.source is not None and planned.get(id(seq.source.seq), -1) < seq.shared:
                continue  # its shared pages are written by a later call (or by its writer's row here)
            take = min(seq.length - 1 - seq.computed, budget)
            if take <= 0:
                break
            # rows pad to the widest: a row joins only while the call computes at most twice its
            # real tokens (or is small anyway) and at most max_prefill_tokens
            padded = pow2(len(rows) + 1) * pow2(max(widest, take), MIN_WIDTH)
            if rows and (padded > self.cfg.max_prefill_tokens or padded > max(2 * (real + take), 256)):
                break
            rows.append((seq, seq.computed, take))
            planned[id(seq)] = seq.computed + take
            widest, real = max(widest, take), real + take
            budget -= take
            if len(rows) == self.cfg.max_prefill_batch:
                break
        num_rows, width = pow2(len(rows)), pow2(widest, MIN_WIDTH)
        ids, pos = np.zeros((num_rows, width), np.int32), np.full((num_rows, width), -1, np.int32)
        wp, wo = np.full((num_rows, width), SINK_PAGE, np.int32), np.zeros((num_rows, width), np.int32)
        tables, lens = [], []
        for i, (seq, start, take) in enumerate(rows):
            ids[i, :take] = (seq.req.input_ids + seq.out_ids)[start:start + take]
            pos[i, :take] = np.arange(start, start + take)
            wp[i, :take], wo[i, :take] = seq.sched.table.write_slots(start, start + take)
            tables.append(seq.sched.table.pages)
            lens.append(start + take)
        self.stats["prefill_padded_tokens"] += num_rows * width
        self.stats["prefill_tokens"] += real
        return rows, (ids, pos, wp, wo, self._work(tables, lens, half_steps))

    def _prefilled(self: PagedEngine, rows: list[tuple[_Seq, int, int]]) -> None:
        """A call wrote ``rows``' tokens (``_prefill_rows``): advance each request not aborted,
        retracted or resumed meanwhile."""
        for seq, start, take in rows:
            if seq.finish_reason is None and seq.sched.table is not None and seq.computed == start:
                seq.computed = start + take
                # a chunk: a call that wrote part of a request's tokens, the rest left for later ones
                self.stats["prefill_chunks"] += seq.computed < seq.length - 1

    def _decode_rows(self: PagedEngine, seqs: list[_Seq], n: int, half_steps: bool = True,
                     num_rows: int | None = None) -> tuple[Any, ...]:
        """The host arrays of up to ``n`` decode tokens of each of ``seqs`` (rows padded to
        ``num_rows``, by default a power of two): tokens, positions, PRNG steps, token counts,
        write pages and offsets ``[rows, n]``, sampling rows and the work list."""
        num_rows = num_rows or pow2(len(seqs), self.min_decode_rows)
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
        work = self._work(tables, lens, half_steps)
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
