"""The decoder's path over a paged KV pool: the pool's layout, and a forward step that writes each
token's keys and values into its page and attends, row by row, over only that row's pages.

A pool is the per-slot cache's layout with a page in place of a slot (``PagedKVCache``); which
pages a request owns, and the ragged work list a step reads through (``attention.PagedWork``),
are the host's business (``inference.pages``). ``Decoder.init_paged_cache`` and
``Decoder.decode_paged`` call through to the functions here; the layers run under the same scan
over stacked parameters as ``Decoder.decode``, carrying the pool.

``mixed_paged_layers`` runs one flat token batch cut into consecutive segments, each a
``[rows, width]`` block of queries with its own work list (the paged engine's mixed step: a
segment of decode rows one token wide, and a segment of prefill rows, a chunk each): projections and MLPs
see the flat batch once, each segment attends through its own ragged list.

A step's ``backend`` argument (``native`` by default; the paged engine passes its
``attention_backend``, ``paged_kernels.choose_attention_backend``) picks what attends over the
gathered pages: the XLA path or a maintained kernel (``models.paged_kernels``). It is a trace-time
choice, never a property of the model: one model serves engines that choose differently. The
pool's layout is the same for both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models.attention import PagedWork, attend_ragged
from areal_jax.models.config import jnp_dtype
from areal_jax.models.layer_stack import layer_modules
from areal_jax.models.paged_kernels import attend_kernel
from sharding import constrain

if TYPE_CHECKING:
    from areal_jax.models.decoder import Attention, Decoder, DecoderLayer


class PagedKVCache(NamedTuple):
    """Every layer's page pool, stacked on a leading ``layers`` axis: keys ``[layers, pages,
    kv_heads, head_dim, page_size]``, values ``[layers, pages, kv_heads, page_size, head_dim]``;
    the per-slot cache's layout with a page in place of a slot. Physical page 0 is the sink that
    padding writes go to (``inference.pages``): a pool for ``n`` usable pages has ``n + 1``."""

    k: jax.Array
    v: jax.Array

    @property
    def page_size(self) -> int:
        return self.v.shape[3]

    @property
    def num_pages(self) -> int:
        """Usable pages (the sink not counted)."""
        return self.k.shape[1] - 1


# Pages are not split over devices: a request's pages may lie anywhere in the pool.
K_PAGE_AXES = ("layers", None, "cache_kv_heads", "head_dim", None)
V_PAGE_AXES = ("layers", None, "cache_kv_heads", None, "head_dim")


def init_paged_cache(model: Decoder, num_pages: int, page_size: int, dtype: Any = None) -> PagedKVCache:
    """A zero pool of ``num_pages`` usable pages of ``page_size`` tokens (plus the sink page);
    ``dtype`` (default: the compute dtype) and KV-head replication as ``Decoder.init_cache``."""
    from areal_jax.models.decoder import kv_head_replicas

    cfg = model.config
    heads = cfg.num_key_value_heads * kv_head_replicas(cfg.num_key_value_heads)
    layers, d = cfg.num_hidden_layers, cfg.head_dim
    dtype = cfg.jnp_dtype if dtype is None else jnp_dtype(dtype, "cache dtype")
    return PagedKVCache(k=jnp.zeros((layers, num_pages + 1, heads, d, page_size), dtype),
                        v=jnp.zeros((layers, num_pages + 1, heads, page_size, d), dtype))


MIN_WORK_SIZE = 32
"""The shortest work list a step attends through: below it a call costs about the same."""


def work_sizes(n: int, least: int = MIN_WORK_SIZE, half_steps: bool | None = None) -> tuple[int, ...]:
    """The lengths a work list of at most ``n`` entries is attended at: ``2**k`` from ``least``,
    with ``half_steps`` also ``3 * 2**(k - 1)`` between them, then ``n`` itself. Attention costs
    the length chosen: powers of two alone leave up to half of it padding, the half steps up to a
    third.

    Each length is one more copy of the attention in every layer of every compiled step
    (``attend_work``'s ``lax.switch``), so the half steps double what a step costs to trace and
    compile. ``half_steps=None``: on every backend but the CPU, where compiling dominates
    (``default_half_steps``)."""
    half = default_half_steps() if half_steps is None else half_steps
    sizes, p = [], least
    while p < n:
        sizes.append(p)
        if half and p >= 2 * least and p * 3 // 2 < n:
            sizes.append(p * 3 // 2)
        p *= 2
    return (*sizes, n)


def default_half_steps() -> bool:
    """Whether ``work_sizes`` takes the half steps by default: not on the CPU. There each length
    of the ladder is one more copy of the attention in every layer of a compiled step, so the
    half steps cost more compile time than their tighter padding saves at run time (the
    side-by-side figures: CHANGELOG, 2026-11-29). Accelerators keep them until a side-by-side
    measurement there says otherwise (there padding entries read the one sink page, which may
    stay in cache)."""
    return jax.default_backend() != "cpu"


def attend_work(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer: jax.Array, positions: jax.Array,
                work: PagedWork, precision: jax.lax.Precision | None = None, backend: str = "native",
                half_steps: bool | None = None) -> jax.Array:
    """``attend_ragged`` of ``q`` over the pages ``work`` names in layer ``layer`` of the pool
    (``[layers, pages, ...]``), gathering exactly those pages (the layer and page indices
    together, so no copy of the layer's whole pool is made first).

    A work list with a ``live`` count has a fixed length (the most a step can read) and is read
    only up to the shortest of ``work_sizes`` that holds the live entries, chosen on device
    (``lax.switch``): the pages a step reads vary from call to call without a new compiled
    shape, and its cost still follows them. Entries past ``live`` are padding (masked).

    ``backend`` (``paged_kernels.resolve_attention_backend``): ``native``, the XLA path;
    ``fa``, the maintained kernel (``paged_kernels.attend_kernel``) over the same gathered pages.
    ``half_steps``: ``work_sizes``' (the engine's steps take the backend's default)."""
    def attend(rows: jax.Array, pages: jax.Array, first: jax.Array) -> jax.Array:
        at = jnp.full_like(pages, layer)
        keys, values = k_pages[at, pages].astype(q.dtype), v_pages[at, pages].astype(q.dtype)
        part = PagedWork(rows, pages, first)

        def native() -> jax.Array:
            return attend_ragged(q, keys, values, positions, part, precision)

        if backend == "fa":
            return attend_kernel(q, keys, values, positions, part, native)
        return native()

    if work.live is None:
        return attend(work.rows, work.pages, work.first)
    sizes = work_sizes(work.pages.shape[0], half_steps=half_steps)
    if len(sizes) == 1:
        return attend(work.rows, work.pages, work.first)
    branches = [lambda r, p, f, n=n: attend(r[:n], p[:n], f[:n]) for n in sizes]
    # the first size that holds the live entries: a count of the smaller ones (one fused kernel;
    # searchsorted's default lowering is a loop of tiny kernels, and this runs in every layer)
    index = jnp.minimum(jnp.sum(jnp.asarray(sizes, jnp.int32) < work.live), len(sizes) - 1)
    return jax.lax.switch(index, branches, work.rows, work.pages, work.first)


def attention_paged(attn: Attention, x: jax.Array, positions: jax.Array, cache: PagedKVCache, layer: jax.Array,
                    write_pages: jax.Array, write_offsets: jax.Array,
                    work: PagedWork, backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """One attention layer against the pool: the new keys and values of ``x [b, t, hidden]`` go to
    page ``write_pages[b, t]`` at ``write_offsets[b, t]`` (padding: the sink page), then each
    row attends to its own pages through the work list."""
    q, k, v = attn._qkv(x, positions)
    k, v = attn._replicate_kv(k, v, cache.k.shape[2] // attn.num_kv_heads)
    at = jnp.full_like(write_pages, layer)
    # As in slot_cache.attention_decode: the advanced indices apart put [b, t] first, so the target is [b, t, kvh, d].
    k_all = cache.k.at[at, write_pages, :, :, write_offsets].set(k.astype(cache.k.dtype))
    v_all = cache.v.at[at, write_pages, :, write_offsets].set(v.astype(cache.v.dtype))
    out = attend_work(q, k_all, v_all, layer, positions, work, attn.precision, backend)
    return attn.o_proj(out.reshape(*x.shape[:2], -1)), PagedKVCache(k_all, v_all)


class Segment(NamedTuple):
    """``rows x width`` consecutive tokens of a flat batch that attend as ``[rows, width]`` query
    rows through ``work`` (whose ``rows`` index these rows)."""

    rows: int
    width: int
    work: PagedWork


def attention_segments(attn: Attention, x: jax.Array, positions: jax.Array, cache: PagedKVCache, layer: jax.Array,
                       write_pages: jax.Array, write_offsets: jax.Array,
                       segments: tuple[Segment, ...], backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """``attention_paged`` over a flat batch ``x [1, T, hidden]`` (positions, write pages and
    offsets ``[1, T]``) cut into ``segments`` that cover ``T`` in order: every token's keys and
    values are written first, so a segment reads the tokens this call writes for its rows."""
    q, k, v = attn._qkv(x, positions)
    k, v = attn._replicate_kv(k, v, cache.k.shape[2] // attn.num_kv_heads)
    at = jnp.full_like(write_pages, layer)
    k_all = cache.k.at[at, write_pages, :, :, write_offsets].set(k.astype(cache.k.dtype))
    v_all = cache.v.at[at, write_pages, :, write_offsets].set(v.astype(cache.v.dtype))
    outs, start = [], 0
    for seg in segments:
        n = seg.rows * seg.width
        qs = q[0, start:start + n].reshape(seg.rows, seg.width, *q.shape[2:])
        ps = positions[0, start:start + n].reshape(seg.rows, seg.width)
        out = attend_work(qs, k_all, v_all, layer, ps, seg.work, attn.precision, backend)
        outs.append(out.reshape(n, -1))
        start += n
    if start != x.shape[1]:
        raise ValueError(f"segments cover {start} tokens of a batch of {x.shape[1]}")
    return attn.o_proj(jnp.concatenate(outs)[None]), PagedKVCache(k_all, v_all)


def layer_paged(layer: DecoderLayer, x: jax.Array, positions: jax.Array, cache: PagedKVCache, index: jax.Array,
                write_pages: jax.Array, write_offsets: jax.Array,
                work: PagedWork | tuple[Segment, ...], backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """One decoder layer against the pool (``index``: the layer's place in the stacked pool);
    ``work`` a tuple of segments: a flat batch (``attention_segments``)."""
    attend = attention_paged if isinstance(work, PagedWork) else attention_segments
    attn, cache = attend(layer.self_attn, layer.input_layernorm(x), positions, cache, index, write_pages,
                         write_offsets, work, backend)
    x = x + attn
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, cache


def decode_paged(model: Decoder, input_ids: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                 write_pages: jax.Array, write_offsets: jax.Array, work: PagedWork,
                 backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """``Decoder.decode`` against a page pool: ``input_ids [b, t]`` at ``positions [b, t]`` (-1
    for padding) write their keys and values at ``(write_pages, write_offsets) [b, t]`` (the sink
    page for padding) and attend through ``work``, the ragged list of the pages each row reads
    (``inference.pages.paged_work``; it must cover every row's tokens up to its last position).
    ``backend``: ``native`` or ``fa`` (``attend_work``). Returns float32 logits ``[b, t, vocab]``
    and the updated pool."""
    x, cache = decode_paged_layers(model, model.embed_tokens(input_ids), positions, cache,
                                   write_pages=write_pages, write_offsets=write_offsets, work=work, backend=backend)
    return model.logits_from_hidden(model.norm(x)), cache


def decode_paged_layers(model: Decoder, x: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                        write_pages: jax.Array, write_offsets: jax.Array, work: PagedWork,
                        backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """The decoder layers of ``decode_paged`` on embeddings ``x [b, t, hidden]``: a scan over the
    stacked layer parameters carrying the pool, as ``Decoder.decode_layers`` carries the cache."""
    return _scan_layers(model, x, positions, cache, write_pages, write_offsets, work, backend)


def mixed_paged_layers(model: Decoder, x: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                       write_pages: jax.Array, write_offsets: jax.Array, segments: tuple[Segment, ...],
                       backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
    """The decoder layers on a flat batch ``x [1, T, hidden]`` cut into ``segments``
    (``attention_segments``): one call computes decode rows and prefill chunks together."""
    return _scan_layers(model, x, positions, cache, write_pages, write_offsets, tuple(segments), backend)


def _scan_layers(model: Decoder, x: jax.Array, positions: jax.Array, cache: PagedKVCache, write_pages: jax.Array,
                 write_offsets: jax.Array, work: PagedWork | tuple[Segment, ...],
                 backend: str) -> tuple[jax.Array, PagedKVCache]:
    split = layer_modules(model.layers)
    if split is not None:  # one array per layer (models.layer_stack): read in place, no slice copied
        for i, layer in enumerate(split):
            x, cache = layer_paged(layer, x, positions, cache, jnp.int32(i), write_pages, write_offsets, work, backend)
            cache = PagedKVCache(constrain(cache.k, K_PAGE_AXES), constrain(cache.v, V_PAGE_AXES))
        return x, cache
    graphdef, params = nnx.split(model.layers)
    layers = model.config.num_hidden_layers

    def body(carry: tuple[jax.Array, PagedKVCache], xs: tuple[nnx.State, jax.Array]) -> tuple:
        x, cache = carry
        layer_params, index = xs
        x, cache = layer_paged(nnx.merge(graphdef, layer_params), x, positions, cache, index, write_pages,
                               write_offsets, work, backend)
        return (x, PagedKVCache(constrain(cache.k, K_PAGE_AXES), constrain(cache.v, V_PAGE_AXES))), None

    unroll = min(model.config.decode_unroll, layers)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (params, jnp.arange(layers)), unroll=unroll)
    return x, cache
