"""Reading and writing Hugging Face model directories: round trip, sharded files, bad input."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from areal_jax.models import CheckpointError, assign_hf_tensors, hf_tensor_specs, load_pretrained, save_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from tests.models.parity import PARITY_TOL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _logits(model, ids):
    return np.asarray(model(jnp.asarray(ids)))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_round_trip_through_transformers(family: str, tmp_path: Path) -> None:
    """load -> save -> load with transformers: the same logits; the same tensor names and shapes."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    model = load_pretrained(FIXTURES / f"hf_{family}")
    save_pretrained(model, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert np.abs(_logits(model, ids) - ref).max() < PARITY_TOL
    ours = load_file(str(tmp_path / "out" / "model.safetensors"))
    original = load_file(str(FIXTURES / f"hf_{family}" / "model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in original.items()}
    assert set(ours) == set(hf.state_dict()) - ({"lm_head.weight"} if hf.config.tie_word_embeddings else set())


def test_round_trip_without_torch(tmp_path: Path) -> None:
    model = load_pretrained(FIXTURES / "hf_llama")
    save_pretrained(model, tmp_path / "a")
    again = load_pretrained(tmp_path / "a")
    ids = np.arange(12)[None] % 96
    np.testing.assert_array_equal(_logits(model, ids), _logits(again, ids))
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["rope_parameters"]["rope_type"] == "llama3"


def test_tied_embeddings_write_no_lm_head(tmp_path: Path) -> None:
    model = load_pretrained(FIXTURES / "hf_qwen2")
    assert model.config.tie_word_embeddings
    assert "lm_head.weight" not in hf_tensor_specs(model)
    save_pretrained(model, tmp_path / "o")
    assert "lm_head.weight" not in load_file(str(tmp_path / "o" / "model.safetensors"))


def test_multi_file_checkpoint_with_index(tmp_path: Path) -> None:
    model = load_pretrained(FIXTURES / "hf_qwen3")
    save_pretrained(model, tmp_path / "sharded", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    again = load_pretrained(tmp_path / "sharded")
    ids = np.arange(10)[None]
    np.testing.assert_array_equal(_logits(model, ids), _logits(again, ids))


def test_bfloat16_policy(tmp_path: Path) -> None:
    f32 = load_pretrained(FIXTURES / "hf_qwen2")
    bf16 = load_pretrained(FIXTURES / "hf_qwen2", dtype="bfloat16")
    assert bf16.layers.mlp.up_proj.kernel[...].dtype == jnp.bfloat16
    ids = np.arange(16)[None] % 96
    out = bf16(jnp.asarray(ids))
    assert out.dtype == jnp.float32  # logits always float32
    err = np.abs(np.asarray(out) - _logits(f32, ids)).max()
    assert 0 < err < 0.05
    save_pretrained(bf16, tmp_path / "bf", dtype="bfloat16")
    assert str(load_file(str(tmp_path / "bf" / "model.safetensors"))["model.norm.weight"].dtype) == "bfloat16"


def test_tiny_checkpoint_has_tokenizer_and_template(tmp_path: Path) -> None:
    from areal_jax.models import encode_chat, load_tokenizer

    d = make_tiny_checkpoint(tmp_path / "tiny")
    tok = load_tokenizer(d)
    ids = encode_chat(tok, [{"role": "user", "content": "2+3="}])
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    model = load_pretrained(d)
    assert max(ids) < model.config.vocab_size
    save_pretrained(model, tmp_path / "copy")
    assert (tmp_path / "copy" / "tokenizer.json").exists()  # tokenizer files travel with the weights


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])  # biases; q/k norms (llama adds no kind)
def test_a_tiny_model_draws_what_the_decoders_initializers_draw(model_type: str) -> None:
    """``random_decoder`` (NumPy, nothing compiled) against ``Decoder(cfg, rngs)``: every
    parameter, its shape, dtype and sharding names, drawn from the same distribution; another
    seed, other numbers."""
    import jax
    from flax import nnx

    from areal_jax.models.config import ModelConfig
    from areal_jax.models.decoder import Decoder
    from areal_jax.models.tiny import TINY_SIZES, random_decoder

    cfg = ModelConfig(model_type=model_type, vocab_size=128, tie_word_embeddings=False, **TINY_SIZES["tiny"])
    ours = nnx.to_flat_state(nnx.state(random_decoder(cfg, seed=1)))
    theirs = dict(nnx.to_flat_state(nnx.state(Decoder(cfg, rngs=nnx.Rngs(1)))))
    assert [p for p, _ in ours] == sorted(theirs) and len(ours) >= 10
    for path, var in ours:
        a, b = np.asarray(var.get_value()), np.asarray(theirs[path].get_value())
        assert a.shape == b.shape and a.dtype == b.dtype, path
        assert var.get_metadata().get("out_sharding") == theirs[path].get_metadata().get("out_sharding"), path
        if path[-1] in ("bias", "weight"):  # zeros and ones
            np.testing.assert_array_equal(a, b, err_msg=str(path))
        else:  # N(0, 0.02): both stds within 5 standard errors of 0.02, means near 0
            for x in (a, b):
                se = 0.02 / np.sqrt(x.size)
                assert abs(x.std() - 0.02) < 5 * se / np.sqrt(2) and abs(x.mean()) < 5 * se, path
    other = nnx.to_flat_state(nnx.state(random_decoder(cfg, seed=2)))
    assert not np.array_equal(np.asarray(ours[0][1].get_value()), np.asarray(other[0][1].get_value()))
    x = jax.numpy.arange(8)[None]
    assert np.isfinite(np.asarray(random_decoder(cfg, seed=1)(x))).all()


# --- bad input: errors name the file, the tensor and the expected shape ----------------------

def _copy(tmp_path: Path, family: str = "qwen2") -> Path:
    d = tmp_path / "m"
    shutil.copytree(FIXTURES / f"hf_{family}", d)
    return d


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_pretrained(tmp_path / "nope")
    d = _copy(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(d)


def test_missing_weights_file(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(d)


def test_unsupported_architecture(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"'gpt2'.*GPT2LMHeadModel.*supported"):
        load_pretrained(d)


def test_missing_and_misshaped_tensor(tmp_path: Path) -> None:
    d = _copy(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.k_proj\.weight' is missing.*\[16, 32\]"):
        load_pretrained(d)
    tensors[name] = np.zeros((16, 31), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*k_proj.*\[16, 31\], expected \[16, 32\]"):
        load_pretrained(d)


def test_assign_rejects_bad_update_and_changes_nothing() -> None:
    model = load_pretrained(FIXTURES / "hf_qwen2")
    ids = np.arange(8)[None]
    before = _logits(model, ids)
    good = np.ones((32,), np.float32)
    with pytest.raises(CheckpointError, match="expected"):
        assign_hf_tensors(model, {"model.norm.weight": good, "model.embed_tokens.weight": np.ones((3, 3))})
    np.testing.assert_array_equal(_logits(model, ids), before)
    assign_hf_tensors(model, {"model.norm.weight": good * 2})
    assert np.abs(_logits(model, ids) - before).max() > 1e-3


def _memory_url(name: str) -> str:
    """A fresh directory on fsspec's in-memory filesystem, a stand-in for gs:// or s3://."""
    import uuid

    return f"memory://bucket-{uuid.uuid4().hex[:8]}/{name}"


def _tree(fs, root: str) -> dict[str, bytes]:
    return {p[len(root.rstrip("/")) + 1:]: fs.cat_file(p) for p in fs.find(root)}


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_save_pretrained_to_url_matches_local_save(tmp_path: Path, scheme: str) -> None:
    """A URL gets byte for byte the files a local save writes (several shards, index, config,
    tokenizer files), and the copy loads back to the same logits."""
    import fsspec

    src = make_tiny_checkpoint(tmp_path / "src", model_type="qwen3", size="tiny")
    model = load_pretrained(src)
    local = save_pretrained(model, tmp_path / "local", max_shard_bytes=64 * 1024)
    url = _memory_url("final") if scheme == "memory" else f"file://{tmp_path}/remote/final"
    assert save_pretrained(model, url + "/", max_shard_bytes=64 * 1024) == url
    fs, root = fsspec.core.url_to_fs(url)
    written = _tree(fs, root)
    expected = {p.name: p.read_bytes() for p in Path(local).iterdir()}
    assert len([n for n in written if n.endswith(".safetensors")]) > 1 and "tokenizer.json" in written
    assert written == expected
    fs.get(root, str(tmp_path / "back"), recursive=True)
    ids = np.arange(12)[None] % 96
    np.testing.assert_array_equal(_logits(load_pretrained(tmp_path / "back"), ids), _logits(model, ids))


def test_save_to_url_replaces_old_files_and_leaves_nothing_on_error(tmp_path: Path) -> None:
    import fsspec

    from areal_jax.models.hf_io import iter_hf_tensors
    from areal_jax.models.hf_write import write_hf_dir

    model = load_pretrained(FIXTURES / "hf_qwen2")
    url = _memory_url("v1")
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/stale.safetensors", b"old")
    save_pretrained(model, url)
    assert "stale.safetensors" not in _tree(fs, root) and "config.json" in _tree(fs, root)

    def failing():
        for i, item in enumerate(iter_hf_tensors(model)):
            if i == 3:
                raise RuntimeError("gather failed")
            yield item

    bad = _memory_url("v2")
    with pytest.raises(RuntimeError, match="gather failed"):
        write_hf_dir(failing(), bad, model.config.to_hf_dict(), max_shard_bytes=1024)
    assert not fs.exists(fsspec.core.url_to_fs(bad)[1])
