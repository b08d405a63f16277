"""Configs the decoder does not implement fail loudly; dtypes are given one way everywhere; the
RoPE and head shapes the committed fixtures do not reach are held against transformers."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import yaml
from flax import nnx
from safetensors.numpy import load_file, save_file

from areal_jax.inference import EngineConfig
from areal_jax.models import CheckpointError, Decoder, ModelConfig, iter_hf_tensors, load_pretrained, save_pretrained
from areal_jax.models.decoder import rope_inv_freq
from areal_jax.trainer.config import TrainConfig
from areal_jax.trainer.run_config import ModelSource, RunConfig
from tests.models.parity import PARITY_TOL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _copy(tmp_path: Path, family: str) -> Path:
    d = tmp_path / family
    shutil.copytree(FIXTURES / f"hf_{family}", d)
    return d


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("family,changes,match", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen2", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama", {"attention_bias": True}, "o_proj bias"),
    ("qwen3", {"attention_bias": True}, "o_proj bias"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5}}, "'yarn'"),
])
def test_unimplemented_config_fails_loudly(tmp_path: Path, family: str, changes: dict, match: str) -> None:
    d = _copy(tmp_path, family)
    _edit_config(d, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(d)


def test_unused_tensor_fails_loudly(tmp_path: Path) -> None:
    """An o_proj bias (say) in the file would be ignored: an error naming it, not a warning."""
    d = _copy(tmp_path, "llama")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)
    tensors["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # derived buffer: still ignored
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"1 tensors .*o_proj\.bias"):
        load_pretrained(d)


@pytest.mark.parametrize("given", ["bfloat16", jnp.bfloat16, np.dtype(ml_dtypes.bfloat16), jnp.dtype("bfloat16")])
def test_dtype_given_as_name_or_dtype(tmp_path: Path, given) -> None:
    assert ModelConfig(dtype=given, param_dtype=given).dtype == "bfloat16"
    assert TrainConfig(compute_dtype=given).compute_dtype == "bfloat16"
    run = RunConfig(model=ModelSource(tiny="tiny", dtype=given))
    for stored in (EngineConfig(cache_dtype=given).cache_dtype, run.model.dtype,
                   ModelConfig().to_hf_dict(given)["torch_dtype"]):
        assert type(stored) is str and stored == "bfloat16"  # a dtype object compares equal to its name
    assert yaml.safe_load(yaml.safe_dump(run.to_dict()))["model"]["dtype"] == "bfloat16"  # as rl.py writes it
    model = load_pretrained(FIXTURES / "hf_qwen2", dtype=given)
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert model.init_cache(2, 8, given).k[0].dtype == jnp.bfloat16
    save_pretrained(model, tmp_path / "out", dtype=given)
    assert load_file(str(tmp_path / "out" / "model.safetensors"))["model.norm.weight"].dtype == ml_dtypes.bfloat16
    assert all(a.dtype == ml_dtypes.bfloat16 for _, a in iter_hf_tensors(model, dtype=given))


def test_float32_dtype_object_and_bad_dtype() -> None:
    assert load_pretrained(FIXTURES / "hf_qwen2", dtype=jnp.float32).config.dtype == "float32"
    with pytest.raises(ValueError, match="param_dtype='int8'"):
        ModelConfig(param_dtype="int8")
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainConfig(compute_dtype=np.int32)
    with pytest.raises(ValueError, match="serving_dtype"):
        ModelConfig().to_hf_dict("float64")
    with pytest.raises(ValueError, match="model.dtype"):
        ModelSource(tiny="tiny", dtype=np.int8)
    with pytest.raises(ValueError, match="cache_dtype"):
        EngineConfig(cache_dtype="int8")
    assert ModelSource(tiny="tiny").dtype is None and EngineConfig().cache_dtype is None


def test_checkpoint_dtype_is_the_default(tmp_path: Path) -> None:
    """A bfloat16 checkpoint loads (and so is served) in bfloat16 unless told otherwise."""
    save_pretrained(load_pretrained(FIXTURES / "hf_qwen3"), tmp_path / "bf", dtype=jnp.bfloat16)
    model = load_pretrained(tmp_path / "bf")
    assert (model.config.param_dtype, model.config.dtype) == ("bfloat16", "bfloat16")
    assert model.norm.weight[...].dtype == jnp.bfloat16
    assert load_pretrained(tmp_path / "bf", dtype="float32").norm.weight[...].dtype == jnp.float32


def test_trainer_compute_dtype_default_fits_the_backend() -> None:
    assert TrainConfig().resolved_compute_dtype("cpu") == "float32"
    assert TrainConfig().resolved_compute_dtype("gpu") == "bfloat16"
    assert TrainConfig().resolved_compute_dtype("tpu") == "bfloat16"
    assert TrainConfig(compute_dtype="float32").resolved_compute_dtype("tpu") == "float32"


LLAMA3_MID_BAND = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}


def test_llama3_scaling_covers_all_three_bands() -> None:
    """head_dim 16, theta 10000, original context 64: wavelengths on both sides of and inside
    [64 / 4, 64], so the interpolated middle band is exercised (the fixture has none there)."""
    cfg = ModelConfig(model_type="llama", head_dim=16, rope_theta=10000.0, rope_scaling=LLAMA3_MID_BAND)
    wavelen = 2 * np.pi / rope_inv_freq(cfg.replace(rope_scaling=None))
    assert (wavelen < 16).any() and (wavelen > 64).any() and ((wavelen > 16) & (wavelen < 64)).any()


@pytest.mark.parametrize("case", ["llama3_mid_band", "qwen3_wide_head_dim"])
def test_live_vs_transformers_beyond_the_fixtures(tmp_path: Path, case: str) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    if case == "llama3_mid_band":
        hf = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0, rope_scaling=LLAMA3_MID_BAND))
    else:  # head_dim 16 while hidden / heads is 8: q/o projections are not square
        hf = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, rope_theta=1e6))
    hf.eval().save_pretrained(str(tmp_path / case))
    model = load_pretrained(tmp_path / case)
    ids = np.random.default_rng(1).integers(0, 96, (2, 120))  # positions past the original context
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(np.asarray(model(jnp.asarray(ids))) - ref).max() < PARITY_TOL


def test_hand_built_config_hashes_with_rope_scaling() -> None:
    cfg = ModelConfig(model_type="llama", rope_scaling=dict(LLAMA3_MID_BAND))
    assert hash(cfg) == hash(cfg.replace()) and cfg == cfg.replace()
    hash(nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))))
