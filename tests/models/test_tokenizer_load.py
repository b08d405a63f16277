"""``load_tokenizer``: what ``AutoTokenizer`` loads, and where it resolved the same files before,
the same tokenizer from the class it chose, without importing torch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from areal_jax.models.tiny import make_tiny_checkpoint
from areal_jax.models.tokenizer import CLASSES_ENV, load_tokenizer

TEXTS = ["What is 12+7? Answer:", "line one\nline two  (spaces)", "<|im_start|>user\nhi<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3=?"}]


def _same(a, b) -> None:
    assert type(a) is type(b)
    for t in TEXTS:
        assert a.encode(t) == b.encode(t) and a.decode(a.encode(t)) == b.decode(b.encode(t))
    assert a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert (len(a), a.eos_token_id, a.pad_token_id, a.bos_token_id, a.model_max_length) == \
        (len(b), b.eos_token_id, b.pad_token_id, b.bos_token_id, b.model_max_length)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {t: make_tiny_checkpoint(root / t, model_type=t) for t in ("qwen3", "llama", "qwen2")}


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2"])
def test_the_second_load_is_what_autotokenizer_loads(dirs: dict[str, Path], model_type: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3 and llama resolve to the generic backend, qwen2's tiny files to ``Qwen2Tokenizer``;
    the second load takes the recorded class directly and gives the same tokenizer."""
    monkeypatch.setenv(CLASSES_ENV, str(tmp_path / "classes.json"))
    reference = AutoTokenizer.from_pretrained(str(dirs[model_type]))
    first, second = load_tokenizer(dirs[model_type]), load_tokenizer(dirs[model_type])
    _same(first, reference)
    _same(second, reference)
    cls = type(reference)
    recorded = list(json.loads((tmp_path / "classes.json").read_text()).values())
    assert recorded == [f"{cls.__module__}:{cls.__qualname__}"]


@pytest.mark.parametrize("model_type,cls", [("qwen3", "TokenizersBackend"), ("qwen2", "Qwen2Tokenizer")])
def test_a_known_tokenizer_loads_without_torch_and_a_changed_one_does_not_reuse_it(
        dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_type: str, cls: str) -> None:
    """A fresh process loads a tokenizer whose files were resolved before without importing torch
    (before: ``AutoTokenizer`` read the model's config, importing torch, every time); files
    changed since (here the chat template) are resolved anew."""
    import shutil

    classes = tmp_path / "classes.json"
    monkeypatch.setenv(CLASSES_ENV, str(classes))
    load_tokenizer(dirs[model_type])
    probe = ("import sys; from areal_jax.models.tokenizer import load_tokenizer; "
             f"t = load_tokenizer({str(dirs[model_type])!r}); print(type(t).__name__, 'torch' in sys.modules)")
    env = {**os.environ, CLASSES_ENV: str(classes), "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == [cls, "False"], out.stderr[-2000:]
    changed = shutil.copytree(dirs[model_type], tmp_path / "changed")
    (changed / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert len(json.loads(classes.read_text())) == 1
    tok = load_tokenizer(changed)
    assert tok.apply_chat_template(CHAT, tokenize=False) == "Be brief.2*3=?"
    assert len(json.loads(classes.read_text())) == 2  # a key of its own


def test_a_record_naming_anything_outside_transformers_is_not_imported(dirs: dict[str, Path], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The record file chooses a class only from ``transformers``: one naming another module is
    ignored (``AutoTokenizer`` decides, and the record is replaced); a record in the older form
    (a generic class's bare name) still loads directly."""
    from areal_jax.models.tokenizer import _files_key

    classes = tmp_path / "classes.json"
    monkeypatch.setenv(CLASSES_ENV, str(classes))
    key = _files_key(dirs["qwen3"])
    classes.write_text(json.dumps({key: "subprocess:Popen"}))
    reference = AutoTokenizer.from_pretrained(str(dirs["qwen3"]))
    _same(load_tokenizer(dirs["qwen3"]), reference)
    assert json.loads(classes.read_text())[key] == f"{type(reference).__module__}:{type(reference).__qualname__}"
    classes.write_text(json.dumps({key: "TokenizersBackend"}))
    _same(load_tokenizer(dirs["qwen3"]), reference)
