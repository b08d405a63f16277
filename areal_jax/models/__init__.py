"""The decoder family (Qwen2/2.5, Qwen3, Llama 3): one Flax NNX definition for packed training
and KV-cache decoding, the critic built on it, Hugging Face checkpoint reading and writing,
tokenizer loading."""

from areal_jax.models.config import FAMILIES, ModelConfig
from areal_jax.models.critic import Critic
from areal_jax.models.decoder import Decoder
from areal_jax.models.fused import fuse_projections, fuse_state
from areal_jax.models.hf_io import (
    CheckpointError,
    HFTensorStream,
    assign_hf_tensors,
    hf_tensor_specs,
    iter_hf_tensors,
    load_pretrained,
)
from areal_jax.models.hf_write import save_pretrained
from areal_jax.models.logprobs import chunked_logprobs, entropy_from_logits, logprobs_from_logits
from areal_jax.models.slot_cache import KVCache
from areal_jax.models.tokenizer import encode_chat, load_tokenizer

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "HFTensorStream",
    "assign_hf_tensors",
    "Critic",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "chunked_logprobs",
    "encode_chat",
    "entropy_from_logits",
    "fuse_projections",
    "fuse_state",
    "hf_tensor_specs",
    "iter_hf_tensors",
    "load_pretrained",
    "load_tokenizer",
    "logprobs_from_logits",
    "save_pretrained",
]
