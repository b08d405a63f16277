"""The decoder family (Qwen2/2.5, Qwen3, Llama 3) as one Flax NNX model.

One definition runs two ways:
- packed, padding-free training input: ``model(input_ids, positions, segment_ids)``; attention
  never crosses a segment and segment 0 is padding;
- batched decoding with a KV cache: ``model.decode(input_ids, positions, cache, kv_len=...)``
  writes the new keys/values at ``positions`` and attends only to the first ``kv_len`` cache slots
  (``models.slot_cache``); ``model.decode_paged(...)`` does the same against a pool of fixed-size
  pages, each row reading only its own pages through a ragged work list (``models.paged``).

The decoder layers are one module with stacked parameters (a leading ``layers`` axis) run under
a scan on both paths, so compile time does not grow with depth; in training each layer can be
rematerialised by a policy, in decoding the scan carries the KV cache, stacked the same way.
Parameters and main activations carry logical axis names; mesh axes live in ``sharding/``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from areal_jax.models import paged, slot_cache
from areal_jax.models.attention import (
    PagedWork,
    attend_packed,
    attend_packed_local,
    attend_packed_pairs,
    dot_product_attention_packed,
    resolve_attention_impl,
    splash_attention_packed,
)
from areal_jax.models.config import ModelConfig
from areal_jax.models.fused import FusedLayout, mlp_shards, qkv_layout, qkv_shards
from areal_jax.models.fused import layouts as fused_layouts
from areal_jax.models.layer_stack import layer_modules
from areal_jax.models.paged import K_PAGE_AXES, V_PAGE_AXES, PagedKVCache  # noqa: F401 (re-exported)
from areal_jax.models.rope import ROPE_SCALINGS, apply_rope, rope_inv_freq  # noqa: F401 (re-exported)
from areal_jax.models.slot_cache import KVCache
from sharding import constrain, logical_axis_size, resharded

# --- layers -----------------------------------------------------------------------------------

class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype: Any, axis: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        if x.ndim == 3:  # hidden states [b, t, h]: one token axis, for the scale's gradient (see Linear)
            x = x.reshape(-1, shape[-1])
        # Normalise in float32 whatever the compute dtype, as HF does.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(x.dtype) * x32.astype(x.dtype)).reshape(shape)


def matmul_precision(cfg: ModelConfig) -> jax.lax.Precision | None:
    """HIGHEST in float32 mode, so float32 means float32 on TPU too (whose default multiplies
    float32 in one bfloat16 pass); the backend default in bfloat16 mode."""
    return jax.lax.Precision.HIGHEST if cfg.dtype == "float32" else None


class Linear(nnx.Linear):
    """``nnx.Linear`` on the input's leading axes merged into one (``[b, t, in]`` as ``[b * t,
    in]``), so the weight gradient contracts one axis, not two: XLA:CPU lays a two-axis
    contraction out through transposing copies, and a decoder layer's gradient took 1.3x as long
    (benchmarks/README.md). A reshape of contiguous axes, free on every backend; under a mesh
    only the batch axis is sharded among those merged, so the merged axis keeps its sharding."""

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim <= 2:
            return super().__call__(x)
        lead = x.shape[:-1]
        return super().__call__(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)


INIT_STD = 0.02
"""The standard deviation of the normal initializer of every matrix and embedding (biases start at
zero, norm scales at one); ``models.tiny.random_decoder`` draws the same distributions."""


def _dense(cfg: ModelConfig, d_in: int, d_out: int, axes: tuple[str, str], *, bias: bool,
           rngs: nnx.Rngs) -> nnx.Linear:
    init = nnx.initializers.normal(INIT_STD)
    return Linear(
        d_in, d_out, use_bias=bias, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
        kernel_init=nnx.with_partitioning(init, axes),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), (axes[1],)),
        precision=matmul_precision(cfg),
        rngs=rngs,
    )


def kv_head_replicas(num_kv_heads: int, logical_axis: str = "cache_kv_heads") -> int:
    """Copies of each KV head the current mesh needs: when the tensor axis is wider than the
    number of KV heads (Qwen2.5-0.5B and 1.5B have 2), each head is replicated over
    ``shards / num_kv_heads`` tensor shards, as SGLang and MaxText do, so every shard holds
    whole heads; otherwise 1 (no mesh, or heads split evenly)."""
    shards = logical_axis_size(logical_axis)
    if shards <= num_kv_heads:
        return 1
    if shards % num_kv_heads:
        raise ValueError(
            f"the mesh splits {logical_axis!r} {shards} ways, more than num_key_value_heads={num_kv_heads} and "
            f"not a multiple of it: KV heads can only be replicated a whole number of times; use a tensor "
            f"axis that divides or is a multiple of {num_kv_heads}"
        )
    return shards // num_kv_heads


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fused_shards: int | None = None):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.use_qkv_bias
        self.qkv_shards = 0
        """0: separate q/k/v projections; else the tensor shards of the fused ``qkv_proj``'s layout."""
        if cfg.fuse_projections:
            shards = logical_axis_size("heads") if fused_shards is None else fused_shards
            self.qkv_shards = qkv_shards(self.num_heads, self.num_kv_heads, shards)
            width = len(qkv_layout(self.num_heads, self.num_kv_heads, d, self.qkv_shards).order)
            self.qkv_proj = _dense(cfg, h, width, ("embed", "heads"), bias=bias, rngs=rngs)
        else:
            # With more tensor shards than KV heads the k/v projections are replicated over the
            # tensor axis (each shard computes all KV heads and keeps its own copy), never split
            # inside a head.
            kv_axis = "kv_heads" if kv_head_replicas(self.num_kv_heads, "kv_heads") == 1 else None
            self.q_proj = _dense(cfg, h, self.num_heads * d, ("embed", "heads"), bias=bias, rngs=rngs)
            self.k_proj = _dense(cfg, h, self.num_kv_heads * d, ("embed", kv_axis), bias=bias, rngs=rngs)
            self.v_proj = _dense(cfg, h, self.num_kv_heads * d, ("embed", kv_axis), bias=bias, rngs=rngs)
        self.o_proj = _dense(cfg, self.num_heads * d, h, ("heads", "embed"), bias=False, rngs=rngs)
        if cfg.family.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype, axis="head_dim")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype, axis="head_dim")
        else:
            self.q_norm = self.k_norm = None
        self.rope_cfg = cfg
        self.precision = matmul_precision(cfg)
        self.attention_impl = cfg.attention_impl
        self.compute_dtype = cfg.dtype

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``[b, t, heads, d]``, k and v ``[b, t, kv, d]`` before norms and RoPE; from the
        fused kernel, ``kv`` is the KV heads with their per-shard copies (``models.fused``)."""
        b, t, _ = x.shape
        d = self.head_dim
        if not self.qkv_shards:
            q = self.q_proj(x).reshape(b, t, self.num_heads, d)
            k = self.k_proj(x).reshape(b, t, self.num_kv_heads, d)
            v = self.v_proj(x).reshape(b, t, self.num_kv_heads, d)
            return q, k, v
        # One matmul; each shard's columns are its queries, keys and values in turn, so the split
        # below stays on the device under a tensor mesh.
        s = self.qkv_shards
        qs = self.num_heads // s * d
        y = self.qkv_proj(x).reshape(b, t, s, -1)
        ks = (y.shape[-1] - qs) // 2
        q = y[..., :qs].reshape(b, t, self.num_heads, d)
        k = y[..., qs:qs + ks].reshape(b, t, -1, d)
        v = y[..., qs + ks:].reshape(b, t, -1, d)
        return q, k, v

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, k, v = self._project(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inv_freq(self.rope_cfg)  # trace-time NumPy, free at run time
        q = constrain(apply_rope(q, positions, inv_freq), ("batch", "length", "act_heads", None))
        k = apply_rope(k, positions, inv_freq)
        return q, k, v

    def _replicate_kv(self, k: jax.Array, v: jax.Array, replicas: int) -> tuple[jax.Array, jax.Array]:
        """``[b, t, kv, d]`` -> ``[b, t, kvh * replicas, d]``, each head repeated in place, so
        query head ``j`` still meets KV head ``j // (num_heads / num_kv_heads)``. ``kv`` may
        already hold copies (a fused kernel's per-shard copies): they are kept or thinned out."""
        heads = self.num_kv_heads * replicas
        have = k.shape[2]
        if have == heads:
            return k, v
        if have > heads:  # copies each ``have // heads`` in a row: keep one of each run
            step = have // heads
            return k[:, :, ::step], v[:, :, ::step]
        if self.num_heads % heads:
            raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of the tensor "
                             f"shards ({heads}) to replicate KV heads over them")
        k, v = jnp.repeat(k, heads // have, axis=2), jnp.repeat(v, heads // have, axis=2)
        names = ("batch", "length", "act_kv_heads", None)
        return constrain(k, names), constrain(v, names)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 window: int | None = None, pairs: jax.Array | None = None, block: int = 64) -> jax.Array:
        q, k, v = self._qkv(x, positions)
        k, v = self._replicate_kv(k, v, kv_head_replicas(self.num_kv_heads, "act_kv_heads"))
        impl = resolve_attention_impl(self.attention_impl, self.compute_dtype)
        if impl == "dot_product":
            out = dot_product_attention_packed(q, k, v, segment_ids, window=window, precision=self.precision)
        elif impl == "splash":
            out = splash_attention_packed(q, k, v, segment_ids, window=window)
        elif pairs is not None:
            out = attend_packed_pairs(q, k, v, segment_ids, pairs, min(block, x.shape[1]), self.precision)
        elif window is None:
            out = attend_packed(q, k, v, segment_ids, self.precision)
        else:
            out = attend_packed_local(q, k, v, segment_ids, window, precision=self.precision)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fused_shards: int | None = None):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_shards = 0
        """0: separate gate/up projections; else the tensor shards of the fused ``gate_up_proj``'s layout."""
        if cfg.fuse_projections:
            shards = logical_axis_size("mlp") if fused_shards is None else fused_shards
            self.gate_up_shards = mlp_shards(i, shards)
            self.gate_up_proj = _dense(cfg, h, 2 * i, ("embed", "mlp"), bias=False, rngs=rngs)
        else:
            self.gate_proj = _dense(cfg, h, i, ("embed", "mlp"), bias=False, rngs=rngs)
            self.up_proj = _dense(cfg, h, i, ("embed", "mlp"), bias=False, rngs=rngs)
        self.down_proj = _dense(cfg, i, h, ("mlp", "embed"), bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.gate_up_shards:
            # One matmul; each shard's columns are its gate then its up (``models.fused``).
            y = self.gate_up_proj(x)
            y = y.reshape(*y.shape[:-1], self.gate_up_shards, 2, -1)
            gate, up = y[..., 0, :].reshape(*x.shape[:-1], -1), y[..., 1, :].reshape(*x.shape[:-1], -1)
            hidden = jax.nn.silu(gate) * up
        else:
            hidden = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(constrain(hidden, ("batch", "length", "act_mlp")))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, fused_shards: tuple[int, int] | None = None):
        norm = partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        attn_shards, mlp_shards_ = (None, None) if fused_shards is None else fused_shards
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, rngs, attn_shards)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg, rngs, mlp_shards_)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 window: int | None = None, pairs: jax.Array | None = None, block: int = 64) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, segment_ids, window, pairs, block)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return constrain(x, ("batch", "length", "act_embed"))


REMAT_POLICIES: dict[str, Any] = {
    "full": None,  # jax.checkpoint's default: keep nothing but the layer's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""``ModelConfig.remat`` -> the ``jax.checkpoint`` policy of a layer (``none`` is no remat)."""
_LAYERS_AXIS = {nnx.PARTITION_NAME: "layers"}  # the stacked axis' logical name, for sharding rules


def stacked_layers(cfg: ModelConfig, rngs: nnx.Rngs, fused_shards: tuple[int, int] | None = None) -> DecoderLayer:
    """``num_hidden_layers`` decoder layers as one module whose parameters have a leading
    ``layers`` axis, each layer initialised from its own split of ``rngs``."""

    @nnx.split_rngs(splits=cfg.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYERS_AXIS)
    def make(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs, fused_shards)

    return make(rngs)


class Decoder(nnx.Module):
    """A causal language model of the Qwen2 / Qwen3 / Llama 3 family."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, fused_shards: tuple[int, int] | None = None):
        """``fused_shards`` (attention, MLP): with ``cfg.fuse_projections``, the tensor shards the
        fused layouts are built for (``models.fused``); None: the current mesh's split of the
        ``heads`` and ``mlp`` axes."""
        # Logical annotations are always recorded; they shard at creation only under a mesh
        # (see sharding.activate), so the same code builds a single-device model.
        with nnx.use_eager_sharding(not jax.sharding.get_abstract_mesh().empty):
            self._build(cfg, rngs, fused_shards)

    def _build(self, cfg: ModelConfig, rngs: nnx.Rngs, fused_shards: tuple[int, int] | None) -> None:
        self.config = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, param_dtype=cfg.jnp_param_dtype,
            embedding_init=nnx.with_partitioning(nnx.initializers.normal(INIT_STD), ("vocab", "embed")),
            rngs=rngs,
        )
        self.layers = stacked_layers(cfg, rngs, fused_shards)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _dense(
            cfg, cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), bias=False, rngs=rngs)

    # -- training / scoring path --

    def hidden_states(self, input_ids: jax.Array, positions: jax.Array | None = None,
                      segment_ids: jax.Array | None = None, *, attention_window: int | None = None,
                      attention_pairs: jax.Array | None = None, attention_block: int = 64) -> jax.Array:
        """Final-norm hidden states ``[batch, tokens, hidden]`` for packed or padded input.

        ``attention_window`` (static): a bound on every segment's length. Attention then looks
        back only that far, so long packed rows cost ``tokens * window``, not ``tokens ** 2``.
        ``attention_pairs`` ``[batch, P, 2]`` (``data.packing.attention_block_pairs`` per row, in
        blocks of ``min(attention_block, tokens)``): the dense path computes only those blocks'
        scores, about ``sum(len ** 2) / 2`` per row (fused paths ignore them).
        """
        if input_ids.ndim == 1:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {input_ids.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1]), input_ids.shape)
        if segment_ids is None:
            segment_ids = jnp.ones_like(input_ids)
        x = constrain(self.embed_tokens(input_ids), ("batch", "length", "act_embed"))

        def layer_fn(x: jax.Array, layer: DecoderLayer) -> jax.Array:
            return layer(x, positions, segment_ids, attention_window, attention_pairs, attention_block)

        split = layer_modules(self.layers)
        if split is not None:  # the serving layout: each layer's own arrays, read in place
            for layer in split:
                x = layer_fn(x, layer)
            return self.norm(x)
        if self.config.remat != "none":
            layer_fn = nnx.remat(layer_fn, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False)
        run = nnx.scan(layer_fn, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_AXIS,
                       unroll=self.train_unroll())
        return self.norm(run(x, self.layers))

    def fused_layouts(self) -> dict[str, FusedLayout]:
        """The fused parameters' layouts by module name (``qkv_proj``, ``gate_up_proj``); empty
        for a model with separate projections."""
        if not self.config.fuse_projections:
            return {}
        return fused_layouts(self.config, (self.layers.self_attn.qkv_shards, self.layers.mlp.gate_up_shards))

    def train_unroll(self) -> int:
        """Layers per iteration of ``hidden_states``' scan: ``ModelConfig.train_unroll``, or by backend."""
        cfg = self.config
        if cfg.train_unroll is not None:
            return min(cfg.train_unroll, cfg.num_hidden_layers)
        return cfg.num_hidden_layers if jax.default_backend() == "cpu" else 1

    def head_weight(self, *, whole: bool = False) -> jax.Array:
        """The head's weight in the parameter dtype: ``[hidden, vocab]``, or the tied embedding
        table ``[vocab, hidden]``. ``whole``: constrained unsharded, so that a loop over token
        chunks (``chunked_logprobs``) reads one copy gathered before it. Gathered inside the loop
        instead, FSDP gathers the head once per chunk forward (bfloat16), again for the
        backward's recompute, and a third time in float32 for the hidden states' gradient (JAX's
        transpose of the float32-output matmul widens the weight before the gather): at
        Qwen2.5-7B on 8 devices 1.09 + 1.09 + 2.18 GB per 1,024-token chunk, beside the
        gradient's reduce-scatter. Whole, it is one 2.18 GB float32 gather a micro-batch; each
        chunk's gradient is still scattered into the weight's shards (``logits_from_hidden``)."""
        w = self.embed_tokens.embedding[...] if self.lm_head is None else self.lm_head.kernel[...]
        return resharded(w, (None, None), self._head_axes) if whole else w

    @property
    def _head_axes(self) -> tuple[str, str]:
        return ("vocab", "embed") if self.lm_head is None else ("embed", "vocab")

    def logits_from_hidden(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Float32 logits ``[..., vocab]``. In bfloat16 mode the head multiplies bfloat16 operands
        (exact products) with float32 accumulation and output, so the logits, and every PPO ratio
        built on them, carry no bfloat16 rounding; in float32 mode it is a HIGHEST-precision matmul.
        ``head``: the weight as ``head_weight`` gives it (default: the parameter)."""
        cfg = self.config
        compute = cfg.jnp_dtype
        hidden = hidden.astype(compute)
        if head is None:
            w = self.head_weight()
        else:  # read whole: its gradient still lands in the parameter's shards
            w = resharded(head, None, self._head_axes)
        w = w.astype(compute)
        if self.lm_head is None:  # tied: the embedding table [vocab, hidden] is the head
            logits = jnp.einsum("...h,vh->...v", hidden, w,
                                precision=matmul_precision(cfg), preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("...h,hv->...v", hidden, w,
                                precision=matmul_precision(cfg), preferred_element_type=jnp.float32)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, *, attention_window: int | None = None,
                 attention_pairs: jax.Array | None = None, attention_block: int = 64) -> jax.Array:
        """Logits ``[batch, tokens, vocab]`` in float32 (arguments as ``hidden_states``)."""
        return self.logits_from_hidden(self.hidden_states(
            input_ids, positions, segment_ids, attention_window=attention_window, attention_pairs=attention_pairs,
            attention_block=attention_block))

    # -- generation path --

    def init_cache(self, num_slots: int, max_len: int, dtype: Any = None) -> KVCache:
        """A zero per-slot cache (``models.slot_cache.init_cache``); ``dtype`` (a name or JAX/NumPy
        dtype) defaults to the compute dtype."""
        return slot_cache.init_cache(self, num_slots, max_len, dtype)

    def decode(self, input_ids: jax.Array, positions: jax.Array, cache: KVCache, *, kv_len: int,
               slots: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Run ``input_ids [b, t]`` at absolute ``positions [b, t]`` against the cache, row i in
        slot ``slots[i]`` (row i when None), attending to the first ``kv_len`` (static) positions
        (``models.slot_cache.decode``): float32 logits ``[b, t, vocab]`` and the updated cache."""
        return slot_cache.decode(self, input_ids, positions, cache, kv_len=kv_len, slots=slots)

    def decode_layers(self, x: jax.Array, positions: jax.Array, cache: KVCache, *, kv_len: int,
                      slots: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """The decoder layers of ``decode`` on embeddings ``x [b, t, hidden]``
        (``models.slot_cache.decode_layers``)."""
        return slot_cache.decode_layers(self, x, positions, cache, kv_len=kv_len, slots=slots)

    # -- generation path over a paged KV pool (models.paged) --

    def init_paged_cache(self, num_pages: int, page_size: int, dtype: Any = None) -> PagedKVCache:
        """A zero pool of ``num_pages`` usable pages of ``page_size`` tokens (plus the sink page);
        ``dtype`` and KV-head replication as ``init_cache``."""
        return paged.init_paged_cache(self, num_pages, page_size, dtype)

    def decode_paged(self, input_ids: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                     write_pages: jax.Array, write_offsets: jax.Array, work: PagedWork,
                     backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
        """``decode`` against a page pool (``models.paged.decode_paged``; ``backend``: the paged
        attention, ``native`` or ``fa``): float32 logits ``[b, t, vocab]`` and the updated pool."""
        return paged.decode_paged(self, input_ids, positions, cache, write_pages=write_pages,
                                  write_offsets=write_offsets, work=work, backend=backend)

    def decode_paged_layers(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache, *,
                            write_pages: jax.Array, write_offsets: jax.Array, work: PagedWork,
                            backend: str = "native") -> tuple[jax.Array, PagedKVCache]:
        """The decoder layers of ``decode_paged`` (``models.paged.decode_paged_layers``)."""
        return paged.decode_paged_layers(self, x, positions, cache, write_pages=write_pages,
                                         write_offsets=write_offsets, work=work, backend=backend)
