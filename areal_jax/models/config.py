"""Model configuration: one dataclass for the decoder family and the table that reads it from,
and writes it back to, a Hugging Face ``config.json``.

Families differ only in data (which biases, which norms, which RoPE scaling), so each family is a
row in ``FAMILIES`` rather than a branch in the model code.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax.core import FrozenDict


@dataclass(frozen=True)
class Family:
    """What distinguishes one Hugging Face architecture of the decoder family."""

    model_type: str
    architecture: str
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2); otherwise read from config's ``attention_bias``."""
    qk_norm: bool
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""
    attention_bias_on_o_proj: bool
    """HF's ``attention_bias`` also puts a bias on o_proj (Llama, Qwen3), which we do not implement."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False, attention_bias_on_o_proj=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True, attention_bias_on_o_proj=True),
    "llama": Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False, attention_bias_on_o_proj=True),
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT_POLICIES = ("none", "full", "dots")
"""Names of the rematerialisation policies (the policies themselves live with the decoder)."""
ATTENTION_IMPLS = ("dense", "dot_product", "splash", "auto")
"""Attention implementations of packed training input (``models.attention``)."""
ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE scalings the decoder implements (``decoder.ROPE_SCALINGS``)."""
_SILU = ("silu", "swish")  # transformers' ACT2FN maps both names to SiLU


def dtype_name(value: Any, field_name: str = "dtype") -> str:
    """The canonical name (``float32``, ``bfloat16``, ``float16``) of a dtype given as a name, a
    JAX/NumPy dtype or a scalar type such as ``jnp.bfloat16``; anything else is a ``ValueError``
    naming ``field_name``. Configs store the name, so they stay hashable and serialisable."""
    try:
        name = value if isinstance(value, str) else np.dtype(value).name
    except TypeError:
        name = None
    if name not in _DTYPES:
        raise ValueError(f"{field_name}={value!r} is not a supported dtype; give one of {sorted(_DTYPES)} "
                         f"(a name, or the JAX/NumPy dtype)")
    return name


def remat_policy(value: bool | str, field_name: str = "remat") -> str:
    """A remat policy name from a name or a bool (True: ``full``, False: ``none``)."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in REMAT_POLICIES:
        raise ValueError(f"{field_name}={value!r}; choose one of {list(REMAT_POLICIES)} (or true / false)")
    return value


def jnp_dtype(value: Any, field_name: str = "dtype") -> Any:
    """The JAX dtype for a name or dtype (see ``dtype_name``)."""
    return _DTYPES[dtype_name(value, field_name)]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder; built from a HF config.json or by hand for tests."""

    model_type: str = "qwen2"
    """A key of FAMILIES: qwen2 (also Qwen2.5), qwen3 or llama (Llama 3)."""
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    """HF rope parameters beyond theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}. Stored
    frozen, so the config (and a GraphDef holding it) stays hashable."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v bias; forced on for families whose FAMILIES row says so."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    """Storage dtype of parameters: float32, bfloat16 or float16 (a name or a JAX/NumPy dtype;
    stored as its name)."""
    dtype: str = "float32"
    """Compute dtype of activations and matmuls, given like ``param_dtype``. Logits are float32
    either way: the LM head accumulates and returns float32."""
    remat: str = "none"
    """What the backward pass keeps of each decoder layer (a key of ``REMAT_POLICIES``): ``none``
    keeps every activation; ``full`` only the layer's input, recomputing the rest (least
    memory, about 1/3 more compute); ``dots`` also keeps the outputs of the weight matmuls and
    recomputes attention and elementwise work (MaxText's "minimal"). True / False mean
    ``full`` / ``none``."""
    attention_impl: str = "dense"
    """Attention over packed training input (a key of ``ATTENTION_IMPLS``): ``dense``, the model's
    own einsum attention (the reference, and the CPU path); ``dot_product``,
    ``jax.nn.dot_product_attention`` (cuDNN flash attention on GPU, bfloat16/float16 only;
    XLA elsewhere); ``splash``, the Pallas splash kernel (TPU); ``auto``, dense on CPU and in
    float32, cuDNN on GPU and splash on TPU in bfloat16/float16. KV-cache decoding always uses
    the dense path. Not a HF config key: set it as a ``load_pretrained`` override."""
    decode_unroll: int = 1
    """Decoder layers per iteration of the KV-cache path's scan over layers (prefill and decode):
    1 compiles one layer whatever the depth; ``num_hidden_layers`` (or more) unrolls them all,
    which compiles in time growing with depth. On CPU unrolling measured no faster (see
    benchmarks/README.md); it is there for backends where the loop itself costs. An engine in
    the default ``layer_layout: split`` runs no scan (it loops over its per-layer weights), and
    this applies only to ``stacked``. Not a HF config key."""
    train_unroll: int | None = None
    """Decoder layers per iteration of the packed path's scan over layers (training, and the
    proximal, reference and critic forward passes). None: all of them on CPU, where XLA:CPU
    runs a loop body's gradient slower than the same layers unrolled (the bench's 2-layer
    model trained 1.17x faster unrolled, and compiled faster; benchmarks/README.md); 1 on GPU
    and TPU. 1 compiles one layer whatever the depth; unrolled layers compile in time growing
    with depth (28 layers: 5.9 s against 2.3 s on CPU). Not a HF config key."""
    fuse_projections: bool = False
    """Hold q/k/v as one ``qkv_proj`` kernel and gate/up as one ``gate_up_proj`` (three fewer
    matmuls a layer; ``models.fused``): for serving. HF tensors in and out keep their unfused
    names either way. Not a HF config key: the engine's loaders set it."""
    extra_hf: dict[str, Any] = field(default_factory=dict, compare=False)
    """Keys of the source config.json we do not interpret, written back unchanged on save."""

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for name in ("param_dtype", "dtype"):
            object.__setattr__(self, name, dtype_name(getattr(self, name), name))
        object.__setattr__(self, "remat", remat_policy(self.remat))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}; choose one of {list(ATTENTION_IMPLS)}")
        if self.decode_unroll < 1:
            raise ValueError(f"decode_unroll={self.decode_unroll}: layers per scan iteration must be >= 1")
        if self.train_unroll is not None and self.train_unroll < 1:
            raise ValueError(f"train_unroll={self.train_unroll}: layers per scan iteration must be >= 1 "
                             "(or None for the backend's default)")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", FrozenDict(self.rope_scaling))
            kind = self.rope_scaling.get("rope_type", "default")
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
        if self.attention_bias and self.family.attention_bias_on_o_proj:
            raise ValueError(
                f"attention_bias=True: a {self.model_type} model then also has an o_proj bias, which this "
                f"decoder does not implement; only attention_bias=False is supported for {self.model_type}"
            )

    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def use_qkv_bias(self) -> bool:
        return self.family.qkv_bias or self.attention_bias

    @property
    def jnp_param_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def jnp_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        nh, kvh = self.num_attention_heads, self.num_key_value_heads
        attn = h * nh * d * 2 + h * kvh * d * 2 + (nh + 2 * kvh) * d * self.use_qkv_bias
        per_layer = attn + 3 * h * i + 2 * h + 2 * d * self.family.qk_norm
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + per_layer * self.num_hidden_layers + h

    # --- Hugging Face config.json -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            archs = hf.get("architectures")
            raise ValueError(
                f"config.json: model_type {model_type!r} (architectures {archs}) is not supported; "
                f"supported model_type values: {sorted(FAMILIES)}"
            )
        # transformers 5 nests theta and scaling in rope_parameters; older files keep rope_theta
        # and rope_scaling at top level. Accept both.
        rope = dict(hf.get("rope_parameters") or {})
        legacy_scaling = hf.get("rope_scaling") or {}
        rope = {**legacy_scaling, **rope}
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        heads = hf["num_attention_heads"]
        _check_supported(hf)
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {
            k: v
            for k, v in hf.items()
            if k not in known and k not in ("rope_parameters", "rope_scaling", "head_dim", "torch_dtype", "dtype")
        }
        # A checkpoint runs in the dtype it was saved in unless told otherwise (a bfloat16 model is
        # served in bfloat16); the trainer keeps its own float32 master copy whatever this says.
        saved = hf.get("torch_dtype") or hf.get("dtype")
        saved = saved if saved in _DTYPES else "float32"
        kw: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            param_dtype=saved,
            dtype=saved,
            extra_hf=extra,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides: Any) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json; a model directory needs one") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"{path}: missing required keys {missing}")
        return cls.from_hf_dict(hf, **overrides)

    def to_hf_dict(self, serving_dtype: Any = None) -> dict[str, Any]:
        """config.json content; ``serving_dtype`` (a name or dtype) is the dtype the tensors are
        written in, default ``param_dtype``."""
        serving_dtype = dtype_name(serving_dtype, "serving_dtype") if serving_dtype is not None else None
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope.update(self.rope_scaling)
        hf: dict[str, Any] = dict(self.extra_hf)
        hf.update(
            architectures=[self.family.architecture],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            # Both spellings: transformers 5 reads rope_parameters, SGLang and older
            # transformers read rope_theta / rope_scaling.
            rope_parameters=rope,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=self.attention_bias,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=serving_dtype or self.param_dtype,
        )
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        return hf


def _check_supported(hf: dict[str, Any]) -> None:
    """Refuse a config.json that asks for something this decoder does not compute: loading it
    anyway would give wrong logits without any error."""
    problems = []
    act = hf.get("hidden_act", "silu")
    if act not in _SILU:
        problems.append(f"hidden_act={act!r} (only silu is implemented)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true (MLP projections without bias only)")
    if hf.get("use_sliding_window"):
        problems.append("use_sliding_window=true (full attention only)")
    if problems:
        raise ValueError(f"config.json asks for {'; '.join(problems)}: this model cannot be loaded faithfully")
