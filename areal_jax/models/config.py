"""Model configuration: one dataclass for the decoder family and the table that reads it from,
and writes it back to, a Hugging Face ``config.json``.

Families differ only in data (which biases, which norms, which RoPE scaling), so each family is a
row in ``FAMILIES`` rather than a branch in the model code.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax.numpy as jnp


@dataclass(frozen=True)
class Family:
    """What distinguishes one Hugging Face architecture of the decoder family."""

    model_type: str
    architecture: str
    qkv_bias: bool
    """q/k/v projections carry a bias (Qwen2); otherwise read from config's ``attention_bias``."""
    qk_norm: bool
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True, qk_norm=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", qkv_bias=False, qk_norm=True),
    "llama": Family("llama", "LlamaForCausalLM", qkv_bias=False, qk_norm=False),
}

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
    rope_scaling: dict[str, Any] | None = None
    """HF rope parameters beyond theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v bias; forced on for families whose FAMILIES row says so."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    param_dtype: str = "float32"
    """Storage dtype of parameters: float32 or bfloat16."""
    dtype: str = "float32"
    """Compute dtype of activations and matmuls: float32 or bfloat16. Logits are always float32."""
    remat: bool = False
    """Rematerialise each decoder layer in the backward pass (trades compute for memory)."""
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
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {sorted(_DTYPES)}")

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
        known = {f.name for f in dataclasses.fields(cls)}
        extra = {
            k: v
            for k, v in hf.items()
            if k not in known and k not in ("rope_parameters", "rope_scaling", "head_dim", "torch_dtype")
        }
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

    def to_hf_dict(self, serving_dtype: str | None = None) -> dict[str, Any]:
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
            attention_bias=self.use_qkv_bias if self.model_type != "qwen2" else self.attention_bias,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            torch_dtype=serving_dtype or self.param_dtype,
        )
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        return hf
