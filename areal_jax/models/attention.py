"""The decoder's attention: the dense forms, their block-sparse form over packed training input, the
fused kernels, and the choice between them.

The dense forms are the CPU path and the reference: ``attend_packed`` (and ``attend_packed_local``
within a window) over packed training rows, ``attend_cached`` against the per-slot KV cache in
decoding, ``attend_paged`` against a paged KV pool through a ragged work list (each row reads
only its own pages; the XLA gather path the paged kernels of ``models.paged_kernels`` are held
against).
Given the block pairs a packed row needs (``data.packing.attention_block_pairs``, planned by the
trainer), ``attend_packed_pairs`` computes the same attention on those blocks only. Where the
backend has a fused kernel, ``ModelConfig.attention_impl`` selects it:

- ``dot_product``: ``jax.nn.dot_product_attention``, cuDNN flash attention on GPU (bfloat16 or
  float16 only), JAX's XLA implementation elsewhere. Packed segments go in as a boolean mask
  (cuDNN adds it as a bias), the causal part and a local window as the kernel's own arguments.
- ``splash``: the Pallas splash-attention kernel for TPU, with segment ids and a causal or
  local mask; block-sparse, so masked-out blocks cost nothing. Off TPU it runs in Pallas
  interpret mode (correct, slow: for tests).
- ``auto``: dense on CPU and whenever compute is float32 (the reference numerics); cuDNN on GPU
  and splash on TPU for bfloat16 / float16.

All take ``q [b, t, heads, d]``, ``k/v [b, t, kv_heads, d]``, ``segment_ids [b, t]`` (0 is
padding) and return ``[b, t, heads, d]``; real tokens never see another segment or padding.
Padding queries attend to padding (never to nothing), so no path produces NaN there.
"""

from __future__ import annotations

import logging
import math
from functools import cache
from typing import Any, NamedTuple

import flax.core.spmd as flax_spmd
import jax
import jax.numpy as jnp

from areal_jax.models.config import ATTENTION_IMPLS
from sharding import logical_to_spec

log = logging.getLogger(__name__)

_FUSED_DTYPES = ("bfloat16", "float16")
_MASKED = -1e30  # finite, so a row with no visible key (padding) gives no NaN


@cache
def _splash_modules() -> tuple[Any, Any]:
    """The splash kernel and mask modules, or an ImportError that says what to do."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask
    except ImportError as e:
        raise ImportError(
            f"attention_impl='splash' needs jax.experimental.pallas.ops.tpu.splash_attention, which does not "
            f"import here ({e}); install a jax with Pallas TPU support or use attention_impl='dense' or 'auto'"
        ) from e
    return kernel, mask


def splash_available() -> bool:
    try:
        _splash_modules()
    except ImportError:
        return False
    return True


def resolve_attention_impl(impl: str, dtype: str, backend: str | None = None) -> str:
    """The implementation ``impl`` runs as on ``backend`` (default: JAX's) with compute
    ``dtype`` (a name): ``auto`` becomes a concrete choice; an explicit fused choice the backend
    cannot run is an error naming the alternative, never a silent fallback."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}; choose one of {list(ATTENTION_IMPLS)}")
    backend = backend or jax.default_backend()
    if impl == "auto":
        if dtype not in _FUSED_DTYPES:
            return "dense"
        if backend == "gpu":
            return "dot_product"
        if backend == "tpu" and splash_available():
            return "splash"
        return "dense"
    if impl == "dot_product" and backend == "gpu" and dtype not in _FUSED_DTYPES:
        raise ValueError(f"attention_impl='dot_product' runs cuDNN flash attention on GPU, which needs bfloat16 or "
                         f"float16 compute, not dtype={dtype!r}; use attention_impl='dense' (or 'auto') in {dtype}")
    if impl == "splash":
        _splash_modules()
    return impl


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                  precision: jax.lax.Precision | None = None) -> jax.Array:
    """Grouped-query attention against a head-major cache: ``q [b, t, nh, d]``,
    ``k [b, kvh, d, s]`` (transposed), ``v [b, kvh, s, d]``, ``mask [b, t, s]``. The queries sharing
    a kv head become the rows of one ``[g * t, d] x [d, s]`` matmul, the shape XLA runs fastest."""
    b, t, nh, d = q.shape
    kvh, s = k.shape[1], k.shape[3]
    g = nh // kvh
    rows = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    scores = jnp.einsum("bkrd,bkds->bkrs", rows, k, preferred_element_type=jnp.float32,
                        precision=precision).reshape(b, kvh, g, t, s)
    scores = jnp.where(mask[:, None, None], scores / math.sqrt(d), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kvh, g * t, s)
    out = jnp.einsum("bkrs,bksd->bkrd", probs, v, precision=precision)
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d)


class PagedWork(NamedTuple):
    """The ragged work list of a paged attention call: one entry per (query row, KV page) pair that
    row reads, ``[n]`` int32 each, built on the host (``inference.pages.paged_work``). A row reads
    only its own pages, so a step costs the tokens live, not rows x the longest row. Padding
    entries name the sink page with ``first`` past every position (fully masked)."""

    rows: jax.Array
    """The query row (batch index) of each entry."""
    pages: jax.Array
    """The physical page it reads."""
    first: jax.Array
    """The absolute position of the page's first token in that row's sequence."""
    live: jax.Array | None = None
    """How many leading entries are real (a scalar), or None: all are read. With a count, the
    list's length is a fixed maximum and a step attends through the shortest of
    ``models.paged.work_sizes`` that holds the live entries (``models.paged.attend_work``), so
    the number of pages read is not part of a compiled step's shape."""


def attend_ragged(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array, work: PagedWork,
                  precision: jax.lax.Precision | None = None) -> jax.Array:
    """Grouped-query attention of ``q [b, t, nh, d]`` (at absolute ``q_positions [b, t]``) over
    the pages of the work list, already gathered: ``keys [n, kvh, d, page]`` (transposed, as the
    cache stores them) and ``values [n, kvh, page, d]``, entry ``i`` belonging to row
    ``work.rows[i]``. A key is visible iff its position is at most the query's, so one call
    serves decode (t = 1) and prefill chunks alike; a padding query (position -1) sees nothing and
    a row with no entries (batch padding) reads nothing: both get finite values, never NaN.

    Each entry's scores are computed on their own and a row's entries are combined by one softmax
    over all of them (the running-max form of flash attention, as in ``attend_packed_pairs``);
    the XLA gather path, and the reference paged kernels are tested against. Each entry holds
    all ``t`` queries of its row, which suits decode and short chunks; a long prefill chunk wants
    entries per (query block, page), so a block skips the pages causality hides from it."""
    b, t, nh, d = q.shape
    n, kvh, _, size = keys.shape
    g = nh // kvh
    rows = q.reshape(b, t, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)
    scores = jnp.einsum("nkrd,nkds->nkrs", rows[work.rows], keys, preferred_element_type=jnp.float32,
                        precision=precision).reshape(n, kvh, g, t, size)
    key_pos = work.first[:, None] + jnp.arange(size, dtype=work.first.dtype)[None]
    mask = key_pos[:, None, :] <= q_positions[work.rows][:, :, None]  # [n, t, page]
    scores = jnp.where(mask[:, None, None], scores / math.sqrt(d), _MASKED)
    shift = jax.ops.segment_max(scores.max(-1), work.rows, num_segments=b)  # [b, kvh, g, t]
    weights = jnp.exp(scores - shift[work.rows][..., None])
    total = jax.ops.segment_sum(weights.sum(-1), work.rows, num_segments=b)
    out = jnp.einsum("nkrs,nksd->nkrd", weights.astype(values.dtype).reshape(n, kvh, g * t, size), values,
                     precision=precision)
    out = jax.ops.segment_sum(out, work.rows, num_segments=b).reshape(b, kvh, g, t, d)
    # A row with no entries (batch padding) has total 0: its output is 0, not NaN. A NaN there
    # would be written as keys and values into the sink page, which masked entries read with
    # weight 0, and 0 * NaN poisons the rows that own them.
    out = out / jnp.where(total > 0, total, 1.0)[..., None].astype(out.dtype)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, nh, d)


def attend_paged(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, q_positions: jax.Array, work: PagedWork,
                 precision: jax.lax.Precision | None = None) -> jax.Array:
    """``attend_ragged`` against one layer's page pool: ``k_pages [num_pages, kvh, d, page]``,
    ``v_pages [num_pages, kvh, page, d]``, read through the work list (the XLA gather path)."""
    return attend_ragged(q, k_pages[work.pages], v_pages[work.pages], q_positions, work, precision)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           precision: jax.lax.Precision | None = None) -> jax.Array:
    """Grouped-query attention. ``q [b, t, nh, d]``, ``k/v [b, s, kvh, d]``, ``mask [b, t, s]``."""
    b, t, nh, d = q.shape
    kvh = k.shape[2]
    q = q.reshape(b, t, kvh, nh // kvh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32, precision=precision)
    scores = jnp.where(mask[:, None, None], scores / math.sqrt(d), _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision)
    return out.reshape(b, t, nh, d)


def attend_packed_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: int,
                        block: int = 128, precision: jax.lax.Precision | None = None) -> jax.Array:
    """Causal segment-masked attention that looks back at most ``window`` positions.

    For packed rows whose segments are all at most ``window`` long this equals full attention,
    at a cost of ``t * (window + block)`` scores per head instead of ``t * t``: the row is cut
    into query blocks, and each attends only to the key blocks that can hold its segments.
    """
    b, t, nh, d = q.shape
    bs = min(block, t)
    pad = (-t) % bs
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    nb = (t + pad) // bs
    back = -(-(max(window, 1) - 1) // bs)  # key blocks behind the query's own block
    if back + 1 >= nb:
        return attend_packed(q, k, v, segment_ids, precision)[:, :t]

    def blocks(x: jax.Array) -> jax.Array:
        return x.reshape(b, nb, bs, *x.shape[2:])

    def slabs(x: jax.Array) -> jax.Array:
        """``[b, nb, (back + 1) * bs, ...]``: for block i, the key blocks i - back .. i."""
        xb = blocks(x)
        xb = jnp.pad(xb, ((0, 0), (back, 0)) + ((0, 0),) * (xb.ndim - 2))  # zero segment = masked
        return jnp.concatenate([xb[:, j : j + nb] for j in range(back + 1)], axis=2)

    index = jnp.broadcast_to(jnp.arange(t + pad), segment_ids.shape)
    seg_q, seg_k = blocks(segment_ids)[..., :, None], slabs(segment_ids)[..., None, :]
    mask = (slabs(index)[..., None, :] <= blocks(index)[..., :, None]) & (seg_q == seg_k) & (seg_k != 0)
    s = (back + 1) * bs
    out = attend(blocks(q).reshape(b * nb, bs, nh, d), slabs(k).reshape(b * nb, s, *k.shape[2:]),
                 slabs(v).reshape(b * nb, s, *v.shape[2:]), mask.reshape(b * nb, bs, s), precision)
    return out.reshape(b, nb * bs, nh, d)[:, :t]


def attend_packed(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                  precision: jax.lax.Precision | None = None) -> jax.Array:
    """Full causal attention within segments; segment 0 is padding."""
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return attend(q, k, v, causal[None] & same & (segment_ids[:, None, :] != 0), precision)


def attend_packed_pairs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, pairs: jax.Array,
                        block: int, precision: jax.lax.Precision | None = None) -> jax.Array:
    """Causal attention within segments computed only on the blocks that need it.

    The row is cut into blocks of ``block`` tokens; ``pairs [b, P, 2]`` lists, per row, the
    (query block, key block) pairs whose scores can be unmasked (``data.packing
    .attention_block_pairs``; unused entries point query block 0 at the last key block, which
    causality masks). Each pair's scores are computed on their own; the pairs of a query block
    are then combined by one softmax over all of them (the running-max form of flash attention,
    the max held constant so the gradient is exact). A packed row of short sequences so costs
    about ``sum(len ** 2) / 2`` scores, not ``tokens * window``. Equal to ``attend_packed`` in
    value and gradient. ``q [b, t, heads, d]``, ``k/v [b, t, kv_heads, d]``, ``t`` a multiple of
    ``block``.
    """
    t, d = q.shape[1], q.shape[3]
    nb = t // block

    def row(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, pairs: jax.Array) -> jax.Array:
        # One packed row at a time (vmapped): the batch axis stays a batch axis, so a mesh that
        # splits rows over devices keeps every gather and segment sum on the row's own device.
        nh, kvh = q.shape[1], k.shape[1]
        g = nh // kvh
        pos = jnp.arange(t, dtype=jnp.int32).reshape(nb, block)
        pq, pk = pairs[:, 0], pairs[:, 1]
        # The queries sharing a kv head are the rows of one [g * block, d] x [d, block] matmul, and
        # keys are stored transposed for it: the shapes XLA multiplies fastest (1.5x on CPU).
        qr = q.reshape(nb, block, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(nb, kvh, g * block, d)
        kt = k.reshape(nb, block, kvh, d).transpose(0, 2, 3, 1)
        vr = v.reshape(nb, block, kvh, d).transpose(0, 2, 1, 3)
        sb = seg.reshape(nb, block)
        sq, sk = sb[pq][:, :, None], sb[pk][:, None, :]
        mask = (sq == sk) & (pos[pk][:, None, :] <= pos[pq][:, :, None]) & ((sk != 0) | (sq == 0))
        scores = jnp.einsum("pkrd,pkds->pkrs", qr[pq], kt[pk], preferred_element_type=jnp.float32,
                            precision=precision).reshape(-1, kvh, g, block, block)
        scores = jnp.where(mask[:, None, None], scores / math.sqrt(d), _MASKED)
        # Per query block, the max over all its pairs: a constant shift, so no gradient through it.
        shift = jax.ops.segment_max(jax.lax.stop_gradient(scores.max(-1)), pq, num_segments=nb)[pq]
        weights = jnp.exp(scores - shift[..., None])
        total = jax.ops.segment_sum(weights.sum(-1), pq, num_segments=nb)  # [nb, kvh, g, block]
        out = jnp.einsum("pkrs,pksd->pkrd", weights.astype(v.dtype).reshape(-1, kvh, g * block, block), vr[pk],
                         precision=precision)
        out = jax.ops.segment_sum(out, pq, num_segments=nb).reshape(nb, kvh, g, block, d)
        out = out / total[..., None].astype(out.dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(t, nh, d)

    run = jax.vmap(row)
    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if not mesh.empty and rules:
        # Each device attends over its own rows and heads: left to the partitioner, the gathers
        # and segment sums over blocks became collectives (7x slower on 8 CPU devices).
        q_spec = logical_to_spec(("batch", None, "act_heads", None), rules)
        kv_spec = logical_to_spec(("batch", None, "act_kv_heads", None), rules)
        run = jax.shard_map(run, in_specs=(q_spec, kv_spec, kv_spec, logical_to_spec(("batch", None), rules),
                                           logical_to_spec(("batch", None, None), rules)),
                            out_specs=q_spec, check_vma=False)
    return run(q, k, v, segment_ids, pairs)


def _segment_mask(segment_ids: jax.Array) -> jax.Array:
    """``[b, 1, t, t]``: query and key in the same segment (padding, 0, with padding)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def dot_product_attention_packed(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                                 window: int | None = None, precision: jax.lax.Precision | None = None,
                                 implementation: str | None = None) -> jax.Array:
    """Causal attention within segments through ``jax.nn.dot_product_attention``.

    ``window``: each query sees itself and at most ``window - 1`` keys before it (the dense
    path's contract: equal to full attention when no segment is longer than ``window``).
    ``implementation``: ``cudnn`` or ``xla``; None picks cuDNN on GPU, XLA elsewhere.
    ``precision`` HIGHEST (float32 mode) makes the XLA implementation's matmuls float32 on TPU.
    """
    if implementation is None:
        implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    kwargs: dict[str, Any] = dict(mask=_segment_mask(segment_ids), is_causal=True, implementation=implementation)
    if window is not None:
        kwargs["local_window_size"] = (max(window, 1) - 1, 0)
    if precision == jax.lax.Precision.HIGHEST:
        with jax.default_matmul_precision("highest"):
            return jax.nn.dot_product_attention(q, k, v, **kwargs)
    return jax.nn.dot_product_attention(q, k, v, **kwargs)


def _splash_block(t: int) -> int:
    """Block size for a row of ``t`` tokens: 512 for long rows, else ``t`` rounded up to 128
    (the kernel's lane width)."""
    return 512 if t >= 512 else max(128, -(-t // 128) * 128)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: int | None,
                  interpret: bool) -> jax.Array:
    """Splash on one device's shard: ``q [b, heads, t, d]`` (already scaled), ``k/v [b, kv_heads, t, d]``."""
    kernel_lib, mask_lib = _splash_modules()
    b, heads, t, _ = q.shape
    block = _splash_block(t)
    pad = (-t) % block
    if pad:  # padded tokens join the padding segment (0): they attend to each other only
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    n = t + pad
    if window is None:
        one = mask_lib.CausalMask(shape=(n, n))
    else:
        one = mask_lib.LocalMask(shape=(n, n), window_size=(max(window, 1) - 1, 0), offset=0)
    sizes = kernel_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                  block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                  block_kv_dq=block)
    kernel = kernel_lib.make_splash_mha(mask=mask_lib.MultiHeadMask([one] * heads), block_sizes=sizes,
                                        head_shards=1, q_seq_shards=1, interpret=interpret)
    seg = segment_ids.astype(jnp.int32)
    out = jax.vmap(kernel)(q, k, v, segment_ids=kernel_lib.SegmentIds(q=seg, kv=seg))
    return out[:, :, :t]


@cache
def _warn_interpret(backend: str) -> None:
    log.warning("splash attention on %s runs in Pallas interpret mode (slow; meant for tests)", backend)


def splash_attention_packed(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                            window: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Causal attention within segments through the Pallas splash kernel (TPU).

    Under a mesh (``sharding.activate``) the kernel runs per device inside ``shard_map``, batch
    and heads split as the logical rules split ``batch``, ``act_heads`` and ``act_kv_heads``.
    ``interpret`` (default: off TPU) runs the kernel in Pallas interpret mode.
    """
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
        if interpret:
            _warn_interpret(jax.default_backend())
    d = q.shape[-1]
    # The kernel does not scale the logits: fold 1/sqrt(d) into the queries.
    q = (q / math.sqrt(d)).astype(q.dtype).transpose(0, 2, 1, 3)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def run(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        return _splash_local(q, k, v, seg, window, interpret)

    mesh = jax.sharding.get_abstract_mesh()
    rules = flax_spmd.get_logical_axis_rules()
    if not mesh.empty and rules:
        q_spec = logical_to_spec(("batch", "act_heads", None, None), rules)
        kv_spec = logical_to_spec(("batch", "act_kv_heads", None, None), rules)
        seg_spec = logical_to_spec(("batch", None), rules)
        run = jax.shard_map(run, in_specs=(q_spec, kv_spec, kv_spec, seg_spec), out_specs=q_spec, check_vma=False)
    return run(q, k, v, segment_ids).transpose(0, 2, 1, 3)
