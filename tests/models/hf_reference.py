"""Reference side of the parity tests: tiny random models built by ``transformers`` (torch CPU)
and their logits on padded and packed input. Imported only where torch is installed."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

FAMILY_CASES = {
    # Qwen2: q/k/v bias, tied embeddings.
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=10000.0)),
    # Qwen3: q/k RMSNorm, explicit head_dim, untied.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8, tie_word_embeddings=False, rope_theta=1e6)),
    # Llama 3.1-style RoPE scaling; small original context so all three frequency bands occur.
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
}

SEQ_LENGTHS = (7, 12, 4)


def make_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    config_cls, model_cls, extra = FAMILY_CASES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    # Random init leaves biases and norm weights at 0/1; perturb them so parity covers them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_sequences(seed: int = 0, vocab: int = 96) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int32) for n in SEQ_LENGTHS]


@torch.no_grad()
def padded_logits(model: torch.nn.Module, seqs: list[np.ndarray]) -> np.ndarray:
    """Right-padded batch with an attention mask: logits [batch, max_len, vocab]."""
    t = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), t), np.int64)
    mask = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits
    return out.float().numpy()


@torch.no_grad()
def per_sequence_logits(model: torch.nn.Module, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """Each sequence run alone: the reference for packed input."""
    return [model(input_ids=torch.tensor(s[None].astype(np.int64))).logits[0].float().numpy() for s in seqs]
