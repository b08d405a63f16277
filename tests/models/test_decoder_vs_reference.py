"""Our decoder against Hugging Face ``transformers`` on tiny random Qwen2, Qwen3 and Llama 3
checkpoints: committed fixtures (no torch needed) and, where torch is installed, a live check."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from areal_jax.models import load_pretrained
from tests.models.parity import PARITY_TOL

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = ["qwen2", "qwen3", "llama"]
TOL = PARITY_TOL


def _split(tokens: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(tokens, np.cumsum(lengths)[:-1])


def padded_input(seqs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    t = max(len(s) for s in seqs)
    ids = np.zeros((len(seqs), t), np.int32)
    seg = np.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], seg[i, : len(s)] = s, 1
    return ids, seg


def packed_input(seqs: list[np.ndarray], pad_to: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All sequences in one row, then padding (segment 0); positions restart per sequence."""
    ids = np.zeros((1, pad_to), np.int32)
    seg, pos = np.zeros_like(ids), np.zeros_like(ids)
    at = 0
    for k, s in enumerate(seqs):
        ids[0, at : at + len(s)] = s
        seg[0, at : at + len(s)] = k + 1
        pos[0, at : at + len(s)] = np.arange(len(s))
        at += len(s)
    return ids, seg, pos


def check_padded(model, seqs, ref_padded) -> float:
    ids, seg = padded_input(seqs)
    out = np.asarray(model(jnp.asarray(ids), segment_ids=jnp.asarray(seg)))
    return max(float(np.abs(out[i, : len(s)] - ref_padded[i, : len(s)]).max()) for i, s in enumerate(seqs))


def check_packed(model, seqs, ref_packed) -> float:
    n = sum(len(s) for s in seqs)
    ids, seg, pos = packed_input(seqs, pad_to=n + 5)
    out = np.asarray(model(jnp.asarray(ids), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg)))
    return float(np.abs(out[0, :n] - ref_packed).max())


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_vs_reference_fixture(family: str, fused: bool) -> None:
    """Both layouts of the projections (``models.fused``, read straight from the HF tensors) give
    transformers' logits."""
    ref = np.load(FIXTURES / f"hf_{family}" / "reference.npz")
    seqs = _split(ref["tokens"], ref["lengths"])
    model = load_pretrained(FIXTURES / f"hf_{family}", fuse_projections=fused)
    assert model.config.fuse_projections == fused
    assert check_padded(model, seqs, ref["padded"]) < TOL
    assert check_packed(model, seqs, ref["packed"]) < TOL


def _mistake_skip_qk_norm(model):
    model.layers.self_attn.q_norm = model.layers.self_attn.k_norm = None  # attention as if Qwen2
    return model


MISTAKES = {
    # (family, how the load goes wrong): config overrides, then a change to the loaded model.
    "llama-rope_theta-1e4": ("llama", {"rope_theta": 10000.0}, None),
    "llama-no-llama3-rope-scaling": ("llama", {"rope_scaling": None}, None),
    "qwen3-qk-norm-skipped": ("qwen3", {}, _mistake_skip_qk_norm),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_tolerance_catches_named_mistakes(name: str) -> None:
    """Each mistake that loads without error but computes a different model fails the parity
    tolerance, while the correct load of the same checkpoint passes it."""
    family, overrides, surgery = MISTAKES[name]
    ref = np.load(FIXTURES / f"hf_{family}" / "reference.npz")
    seqs = _split(ref["tokens"], ref["lengths"])
    assert check_padded(load_pretrained(FIXTURES / f"hf_{family}"), seqs, ref["padded"]) < TOL
    wrong = load_pretrained(FIXTURES / f"hf_{family}", **overrides)
    if surgery is not None:
        wrong = surgery(wrong)
    assert check_padded(wrong, seqs, ref["padded"]) > TOL
    assert check_packed(wrong, seqs, ref["packed"]) > TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_segments_do_not_attend_across(family: str) -> None:
    """Changing one packed sequence leaves the logits of the others untouched."""
    ref = np.load(FIXTURES / f"hf_{family}" / "reference.npz")
    seqs = _split(ref["tokens"], ref["lengths"])
    model = load_pretrained(FIXTURES / f"hf_{family}")
    ids, seg, pos = packed_input(seqs, 30)
    base = np.asarray(model(jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(seg)))
    ids2 = ids.copy()
    ids2[0, : len(seqs[0])] = (ids2[0, : len(seqs[0])] + 1) % 96
    other = np.asarray(model(jnp.asarray(ids2), jnp.asarray(pos), jnp.asarray(seg)))
    n0, n = len(seqs[0]), sum(len(s) for s in seqs)
    assert np.abs(other[0, :n0] - base[0, :n0]).max() > 1e-3  # the edited sequence changed
    np.testing.assert_allclose(other[0, n0:n], base[0, n0:n], atol=1e-6)  # padding after n is don't-care


def test_live_cross_check_vs_transformers(tmp_path: Path) -> None:
    """Fresh random models (new seed) through transformers itself, when it is installed."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.models.hf_reference import make_hf_model, make_sequences, padded_logits, per_sequence_logits

    for family in FAMILIES:
        hf = make_hf_model(family, seed=123)
        hf.save_pretrained(str(tmp_path / family))
        seqs = make_sequences(seed=7)
        model = load_pretrained(tmp_path / family)
        assert check_padded(model, seqs, padded_logits(hf, seqs)) < TOL, family
        assert check_packed(model, seqs, np.concatenate(per_sequence_logits(hf, seqs))) < TOL, family
