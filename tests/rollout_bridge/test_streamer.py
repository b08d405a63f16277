"""The streamer's output is what transformers and SGLang's loaders expect."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flax import nnx

from areal_jax.models import Decoder, ModelConfig, hf_tensor_specs, iter_hf_tensors, load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from rollout_bridge.streamer import DiskSink, buckets


def _hf_model(cfg_dict: dict) -> Any:
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    arch = getattr(transformers, cfg_dict["architectures"][0])
    return arch(config)


@pytest.mark.parametrize("model_type,tied", [("qwen2", True), ("llama", False), ("qwen3", True)])
def test_names_and_shapes_match_hf_state_dict(model_type: str, tied: bool) -> None:
    cfg = ModelConfig(model_type=model_type, vocab_size=96, tie_word_embeddings=tied)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    ours = hf_tensor_specs(model)
    hf = _hf_model(cfg.to_hf_dict("float32"))
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()
              if not (tied and k == "lm_head.weight") and "rotary_emb" not in k}
    assert ours == theirs
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in ours)
    assert ("lm_head.weight" in ours) == (not tied)


def test_buckets_respect_limit() -> None:
    tensors = [(f"t{i}", np.zeros(n, np.float32)) for i, n in enumerate([10, 300, 5, 5, 200, 1000, 1, 1])]
    limit = 1024  # bytes
    groups = list(buckets(iter(tensors), limit))
    assert [n for g in groups for n, _ in g] == [n for n, _ in tensors]  # order kept, nothing lost
    for g in groups:
        size = sum(a.nbytes for _, a in g)
        assert size <= limit or len(g) == 1, (size, [n for n, _ in g])


def test_disk_sink_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    src = make_tiny_checkpoint(tmp_path / "src", model_type="qwen2", size="tiny")
    model = load_pretrained(src)
    sink = DiskSink(tmp_path / "weights", model.config.to_hf_dict("float32"), tokenizer_dir=src, keep_last=2,
                    max_shard_bytes=64 * 1024)
    metrics = [asyncio.run(sink.push(v, iter_hf_tensors(model, "float32"))) for v in range(3)]
    assert [p.name for p in sorted((tmp_path / "weights").glob("v*"))] == ["v00000001", "v00000002"]
    assert not list((tmp_path / "weights").glob(".*tmp*"))  # no temp dir left behind
    m = metrics[-1]
    assert m.bytes == sum(a.nbytes for _, a in iter_hf_tensors(model, "float32")) and m.seconds > 0
    path = Path(m.path)
    assert (path / "model.safetensors.index.json").exists() and (path / "tokenizer.json").exists()

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = np.array([[5, 17, 3, 42, 9, 11, 60, 2]])
    with torch.no_grad():
        theirs = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(model(ids))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_file_skips_cleanly_without_torch() -> None:
    """torch is a test-only extra: without it this file must skip its torch tests, not fail to collect."""
    code = ("import sys; sys.modules['torch'] = None; import pytest; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {__file__!r}, '-k', 'not without_torch']))")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" in proc.stdout and "error" not in proc.stdout.lower(), proc.stdout[-3000:]
