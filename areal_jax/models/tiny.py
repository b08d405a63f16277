"""Tiny random checkpoints for the quick start, tests and benchmarks: a real HF model directory
(config.json, safetensors, tokenizer files with a chat template) that needs no download.

The tokenizer has one token per character (of those arithmetic and short reasoning tasks use),
built with the ``tokenizers`` library.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from areal_jax.models.config import ModelConfig
from areal_jax.models.decoder import INIT_STD, Decoder
from areal_jax.models.hf_write import save_pretrained

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHARS = string.digits + string.ascii_letters + " \n+-*/=()<>.,:;?!'\"#%&[]{}_^|~$@\\`"

# A ChatML template, the convention of the Qwen family.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_OPTIONS_SET_BY_BUILDER = ("model_type", "vocab_size", "eos_token_id", "pad_token_id")
"""``ModelConfig`` fields ``make_tiny_checkpoint`` sets itself (the character tokenizer's, and
``model_type`` from its own argument), so a tiny model's options cannot."""

TINY_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32),
}


def build_char_tokenizer() -> Any:
    """A byte-level BPE with no merges over ``CHARS``: one token per character, the same pipeline
    (ByteLevel pre-tokenizer and decoder) as Qwen's and Llama 3's, so every loader, including
    ``transformers``' model-specific tokenizer classes and SGLang, treats it identically."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_char = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + [byte_char[ord(c)] for c in CHARS])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|pad|>", bos_token=None)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_decoder(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A ``Decoder`` of ``cfg`` with its initializers' distributions (matrices and embeddings
    normal with std ``INIT_STD``, biases zero, norm scales one), drawn by NumPy from ``seed``.

    The same distributions as ``Decoder(cfg, rngs=nnx.Rngs(seed))``, not the same numbers: that
    runs every initializer as its own small XLA program, a few seconds of compiling in every
    process that writes a tiny model (each run of the quick start, each test run and server),
    where this compiles nothing."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    values = []
    for path, var in nnx.to_flat_state(abstract):
        spec = var.get_value()
        kind = path[-1]
        if kind in ("kernel", "embedding"):
            value = rng.normal(0.0, INIT_STD, spec.shape)
        elif kind in ("bias", "weight"):  # zeros; an RMSNorm scale, ones
            value = np.full(spec.shape, float(kind == "weight"))
        else:
            raise ValueError(f"random_decoder: no initializer for parameter {'.'.join(map(str, path))}")
        values.append((tuple(path), jnp.asarray(value, dtype=spec.dtype)))
    return nnx.merge(graphdef, nnx.from_flat_state(values))


def make_tiny_checkpoint(
    out_dir: str | os.PathLike,
    *,
    model_type: str = "qwen2",
    size: str = "tiny",
    seed: int = 0,
    tie_word_embeddings: bool = True,
    **overrides: Any,
) -> Path:
    """Write a random ``model_type`` model of ``size`` plus a character tokenizer to ``out_dir``."""
    out_dir = Path(out_dir)
    tok = build_char_tokenizer()
    vocab = 128  # room above the tokenizer's ids, a multiple of 8 like real vocabularies
    assert len(tok) <= vocab
    cfg = ModelConfig(
        model_type=model_type, vocab_size=vocab, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=4096, rope_theta=10000.0,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|pad|>"),
        **{**TINY_SIZES[size], **overrides},
    )
    model = random_decoder(cfg, seed)
    save_pretrained(model, out_dir)
    tok.save_pretrained(str(out_dir))
    return out_dir
