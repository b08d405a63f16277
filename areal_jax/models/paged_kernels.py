"""Maintained paged-attention kernels behind the paged engine's ``--attention-backend``, and the
choice between them and the XLA gather path (``attention.attend_ragged``, the reference).

Backends, named as sglang-jax names them:

- ``native``: the XLA gather path; runs everywhere, the reference the kernels are tested against.
- ``fa``: the backend's maintained flash-attention kernel over pages.
  On TPU, ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` (the kernel family
  sglang-jax and vLLM-TPU run) for decode rows and prefill chunks alike. On GPU, Pallas GPU
  ``paged_attention`` (lowered through Triton) for decode rows (one query per row); a prefill
  chunk (several queries per row) stays on the XLA path there, since that kernel has no causal
  mask within a row's queries.
- ``auto``: ``fa`` where its constraints hold (backend, dtype, head_dim, page size), else
  ``native``. An explicit ``fa`` the backend cannot run is an error at start naming the flag.

Layout. The pool keeps its layout (``models.paged.PagedKVCache``: keys ``[pages, kvh, d, page]``,
values ``[pages, kvh, page, d]`` per layer) for every backend: a step already gathers the pages
its work list names (what the XLA path reads anyway), and the kernel's own layout is built from
those gathered pages only, with a page table that indexes the gathered set. A step so never
copies or transposes the whole pool, and the kernel still does the flash attention (one pass,
no per-entry score tensor in HBM). A kernel-native pool (TPU: one ``[pages, page, 2 * kvh, d]``
array with k and v interleaved; GPU: ``[kvh, pages, page, d]``) would save that gather too; it
changes the writes and the pool's sharding, and is worth it only once a profile on the device
shows the gather matters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from areal_jax.models.attention import PagedWork

ATTENTION_BACKENDS = ("auto", "native", "fa")
"""Values of ``EngineConfig.attention_backend`` / ``areal-jax serve --attention-backend``."""

_FAST_DTYPES = ("bfloat16", "float16")
AUTO_TAKES_KERNELS = False
"""Whether ``auto`` takes a kernel where it can run. Not yet: neither kernel has run on a GPU or
TPU (the GPU kernel is tested in Pallas interpret mode, the TPU kernel's inputs through its
module's reference), so a default that changes what a user's device computes waits for a device
run that checks them against ``native`` and measures them; ``fa`` asks for them meanwhile."""


def kernel_constraints(backend: str, *, dtype: str, head_dim: int, page_size: int, num_heads: int,
                       num_kv_heads: int) -> str | None:
    """Why ``fa`` cannot run on ``backend`` with these shapes, or None when it can."""
    if backend == "tpu":
        if head_dim % 128:
            return f"the TPU ragged paged attention kernel needs head_dim a multiple of 128, not {head_dim}"
        try:
            from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import get_min_heads_per_blk
        except ImportError as e:
            return f"jax.experimental.pallas.ops.tpu.ragged_paged_attention does not import here ({e})"
        try:  # the kernel's own check of how k and v heads tile together
            get_min_heads_per_blk(num_heads, 2 * num_kv_heads, jnp.dtype(dtype), jnp.dtype(dtype))
        except ValueError as e:
            return f"the TPU ragged paged attention kernel cannot tile {num_kv_heads} kv heads ({e})"
        return None
    if backend == "gpu":
        try:
            import jax.experimental.pallas.ops.gpu.paged_attention  # noqa: F401
        except ImportError as e:
            return f"jax.experimental.pallas.ops.gpu.paged_attention does not import here ({e})"
        # Triton's dot wants power-of-two tiles of at least 16 on each side.
        if head_dim < 16 or head_dim & (head_dim - 1):
            return f"the Pallas GPU paged attention kernel needs head_dim a power of two >= 16, not {head_dim}"
        if page_size < 16 or page_size & (page_size - 1):
            return f"the Pallas GPU paged attention kernel needs --page-size a power of two >= 16, not {page_size}"
        return None
    return f"no paged attention kernel runs on {backend!r}"


def resolve_attention_backend(choice: str, *, dtype: str, head_dim: int, page_size: int, num_heads: int,
                              num_kv_heads: int, backend: str | None = None) -> str:
    """``native`` or ``fa``: what ``choice`` runs as on ``backend`` (default: JAX's). ``auto`` is
    ``native`` while ``AUTO_TAKES_KERNELS`` is off; with it on, the kernel where it can run and
    compute is bfloat16/float16 (float32 keeps the reference numerics)."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {choice!r}: choose one of {list(ATTENTION_BACKENDS)}")
    backend = backend or jax.default_backend()
    why = kernel_constraints(backend, dtype=dtype, head_dim=head_dim, page_size=page_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads)
    if choice == "auto":
        return "fa" if AUTO_TAKES_KERNELS and why is None and dtype in _FAST_DTYPES else "native"
    if choice == "fa" and why is not None:
        raise ValueError(f"--attention-backend fa: {why}; use --attention-backend native (or auto)")
    return choice


def page_tables(work: PagedWork, kv_lens: jax.Array, page_size: int, width: int) -> jax.Array:
    """``[b, width]`` int32: entry ``j`` of row ``r`` is the index, in the work list, of the entry
    holding that row's tokens ``j * page_size ..``; columns past a row's pages point at entry 0
    (any valid page: the kernels never read past ``kv_lens``). Padding entries (``first`` at or
    past the row's length) are dropped, so they never overwrite a real one."""
    b = kv_lens.shape[0]
    n = work.pages.shape[0]
    live = work.first < kv_lens[work.rows]
    rows = jnp.where(live, work.rows, b)  # out of range: dropped
    cols = jnp.where(live, work.first // page_size, 0)
    return jnp.zeros((b, width), jnp.int32).at[rows, cols].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def row_lengths(q_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(kv_lens, q_lens)`` ``[b]`` int32: the tokens a row attends to (its last query's position
    plus one; 0 for a padding row) and its real queries (positions >= 0, a prefix of the row)."""
    kv_lens = (q_positions.max(axis=1) + 1).astype(jnp.int32)
    return jnp.maximum(kv_lens, 0), (q_positions >= 0).sum(axis=1).astype(jnp.int32)


# -- TPU: ragged paged attention --

class RaggedInputs(NamedTuple):
    """``ragged_paged_attention``'s inputs for one call, and where its packed outputs go back."""

    q: jax.Array  # [b * t, heads, d]: every row's real queries, packed in row order, then padding
    kv_pages: jax.Array  # [n, page, 2 * kvh, d]: the gathered pages, k at even heads, v at odd
    kv_lens: jax.Array  # [b]
    page_indices: jax.Array  # [b, n]: into kv_pages
    cu_q_lens: jax.Array  # [b + 1]
    num_seqs: jax.Array  # [1]
    order: jax.Array  # [b * t]: packed query i is flat query order[i] of [b, t]


def ragged_inputs(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array,
                  work: PagedWork) -> RaggedInputs:
    """The ragged kernel's inputs from ``attend_ragged``'s: ``q [b, t, nh, d]`` at ``q_positions``
    and the gathered pages ``keys [n, kvh, d, page]``, ``values [n, kvh, page, d]``. The kernel
    takes a row's queries as its last ``q_len`` tokens (query ``i`` at ``kv_len - q_len + i``),
    which is how the engine lays a row out: its real queries first, at consecutive positions
    ending at the last token the row attends to."""
    b, t, nh, d = q.shape
    n, kvh, _, size = keys.shape
    kv_lens, q_lens = row_lengths(q_positions)
    order = jnp.argsort(q_positions.reshape(-1) < 0, stable=True).astype(jnp.int32)
    kv = jnp.stack([keys.transpose(0, 3, 1, 2), values.transpose(0, 2, 1, 3)], axis=3)  # [n, page, kvh, 2, d]
    return RaggedInputs(
        q=q.reshape(b * t, nh, d)[order], kv_pages=kv.reshape(n, size, 2 * kvh, d), kv_lens=kv_lens,
        page_indices=page_tables(work, kv_lens, size, n),
        cu_q_lens=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_lens, dtype=jnp.int32)]),
        num_seqs=jnp.array([b], jnp.int32), order=order)


def attend_ragged_tpu(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array, work: PagedWork,
                      kernel: Callable[..., jax.Array] | None = None) -> jax.Array:
    """``attend_ragged`` through the TPU ragged paged attention kernel (``kernel``: another
    function of the same signature, e.g. the kernel module's reference, for tests off TPU).
    Padding queries get 0."""
    if kernel is None:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as kernel
    b, t, nh, d = q.shape
    x = ragged_inputs(q, keys, values, q_positions, work)
    packed = kernel(x.q, x.kv_pages, x.kv_lens, x.page_indices, x.cu_q_lens, x.num_seqs, sm_scale=1 / math.sqrt(d))
    return unpack(packed, x, q.shape)


def unpack(packed: jax.Array, x: RaggedInputs, shape: tuple[int, ...]) -> jax.Array:
    """The ragged kernel's packed output ``[<= b * t, heads, d]`` back to ``shape`` ``[b, t,
    heads, d]``, padding queries 0 (the kernel leaves the rows past ``cu_q_lens[-1]`` unset; its
    reference returns only the real ones)."""
    b, t = shape[:2]
    packed = jnp.pad(packed, ((0, b * t - packed.shape[0]), (0, 0), (0, 0)))
    packed = jnp.where((jnp.arange(b * t) < x.cu_q_lens[-1])[:, None, None], packed, 0)
    return jnp.zeros_like(packed).at[x.order].set(packed).reshape(shape)


# -- GPU: Pallas paged attention (decode) --

def _gpu_blocks(n: int) -> tuple[int, int, int]:
    """(pages per row in the table, pages per compute block, k splits): the kernel wants the
    table's width divisible by ``k_splits * pages_per_compute_block``."""
    block = min(8, n)
    width = -(-n // block) * block
    return width, block, math.gcd(width // block, 16)


def attend_paged_gpu(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array, work: PagedWork,
                     interpret: bool | None = None) -> jax.Array:
    """``attend_ragged`` for decode (``t == 1``) through Pallas GPU ``paged_attention``
    (``interpret``, default off GPU: Pallas interpret mode, for tests). Padding rows get 0."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    b, t, nh, d = q.shape
    if t != 1:
        raise ValueError(f"the Pallas GPU paged attention kernel takes one query per row, not {t}")
    n, kvh, _, size = keys.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    kv_lens, _ = row_lengths(q_positions)
    width, block, splits = _gpu_blocks(n)
    tables = page_tables(work, kv_lens, size, width)
    # The kernel does not scale the logits: fold 1/sqrt(d) into the queries.
    scaled = (q[:, 0] / math.sqrt(d)).astype(q.dtype)
    out = paged_attention(scaled, keys.transpose(1, 0, 3, 2), values.transpose(1, 0, 2, 3), tables, kv_lens,
                          block_h=16, pages_per_compute_block=block, k_splits=splits, interpret=interpret)
    return jnp.where((kv_lens > 0)[:, None, None], out, 0).astype(q.dtype)[:, None]


def attend_kernel(q: jax.Array, keys: jax.Array, values: jax.Array, q_positions: jax.Array, work: PagedWork,
                  fallback: Callable[[], jax.Array], platform: str | None = None, **kw: Any) -> jax.Array:
    """``fa`` on ``platform`` (default: JAX's backend): the TPU ragged kernel on TPU; elsewhere
    the GPU decode kernel for one query per row, ``fallback()`` (the XLA path) for a prefill chunk."""
    if (platform or jax.default_backend()) == "tpu":
        return attend_ragged_tpu(q, keys, values, q_positions, work, **kw)
    if q.shape[1] == 1:
        return attend_paged_gpu(q, keys, values, q_positions, work, **kw)
    return fallback()


def choose_attention_backend(cfg: Any, choice: str, *, page_size: int, devices: int = 1) -> str:
    """What ``choice`` runs as (``native`` or ``fa``) for a model of config ``cfg`` (a
    ``ModelConfig``) on JAX's backend: the value a paged engine passes its compiled steps as their
    static ``attention_backend`` (``inference.paged_steps``). ``devices``: the engine's mesh size;
    the kernels run on one device (no shard_map over them yet), so a mesh runs ``native``."""
    if devices > 1:
        if choice == "fa":
            raise ValueError(f"--attention-backend fa runs on one device, not over a mesh of {devices}; "
                             "use --attention-backend native (or auto)")
        resolved = "native" if choice == "auto" else resolve_attention_backend(
            choice, dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=page_size,
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads)
    else:
        resolved = resolve_attention_backend(choice, dtype=cfg.dtype, head_dim=cfg.head_dim, page_size=page_size,
                                             num_heads=cfg.num_attention_heads,
                                             num_kv_heads=cfg.num_key_value_heads)
    return resolved
