"""Tokenizer and chat template of a model directory, through ``transformers``' fast tokenizer.

Nothing here tokenizes by itself: we load what the ecosystem's libraries load, so our token ids
and chat formatting are the ones SGLang and ``transformers`` produce for the same directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from areal_jax import CACHE_ROOT


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The ``transformers`` tokenizer saved in ``model_dir`` (tokenizer.json and its config):
    what ``AutoTokenizer`` loads. Where ``AutoTokenizer`` resolved the same files (under the same
    ``transformers``) before, the class it chose loads them directly, as ``AutoTokenizer`` itself
    then does: the same tokenizer without ``AutoTokenizer`` reading the model's config, which
    imports torch (1.5-3 s of a run's start, in the trainer and again in each server, on a loaded
    2-core CPU; a model-specific class such as ``Qwen2Tokenizer`` loaded 1.81 CPU-s through
    ``AutoTokenizer`` against 0.68 directly)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise FileNotFoundError(
            f"{model_dir}: no tokenizer.json or tokenizer_config.json; copy the tokenizer files "
            "of the base model into this directory"
        )
    key = _files_key(model_dir)
    cls = _recorded_class(_known_classes().get(key)) if key is not None else None
    if cls is not None:
        return cls.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if key is not None:
        _remember_class(key, f"{type(tokenizer).__module__}:{type(tokenizer).__qualname__}")
    return tokenizer


def _recorded_class(record: str | None) -> Any:
    """The tokenizer class a record names (``module:qualname``, or a generic class's bare name as
    older records have it), or None: no record, or one naming anything outside ``transformers``
    (the record file is not trusted to choose what gets imported)."""
    if record is None:
        return None
    if ":" not in record:
        if record not in GENERIC_CLASSES:
            return None
        from transformers import TokenizersBackend

        return TokenizersBackend
    module, _, name = record.partition(":")
    if module != "transformers" and not module.startswith("transformers."):
        return None
    try:
        import importlib

        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``AutoTokenizer``'s outcomes that it loads with a plain ``TokenizersBackend.from_pretrained``
(the two names are one class in ``transformers`` 5); model-specific classes go through it."""

CLASSES_ENV = "AREAL_JAX_TOKENIZER_CLASSES"
"""Where ``load_tokenizer`` keeps what ``AutoTokenizer`` resolved (a small JSON file); default
``~/.cache/areal-jax/tokenizer-classes.json``."""


def _classes_path() -> Path:
    return Path(os.environ.get(CLASSES_ENV) or Path(CACHE_ROOT, "tokenizer-classes.json")).expanduser()


def _files_key(model_dir: Path) -> str | None:
    """A digest of what ``AutoTokenizer``'s choice depends on: the ``transformers`` version, the
    model type (config.json) and every tokenizer file's bytes; None where unreadable."""
    from importlib.metadata import version

    from areal_jax.models.hf_io import TOKENIZER_FILES

    try:
        h = hashlib.sha256(version("transformers").encode())
        config = model_dir / "config.json"
        model_type = json.loads(config.read_text()).get("model_type") if config.exists() else None
        h.update(repr(model_type).encode())
        for name in TOKENIZER_FILES:
            if (model_dir / name).exists():
                h.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
        return h.hexdigest()
    except Exception:
        return None


def _known_classes() -> dict[str, str]:
    try:
        known = json.loads(_classes_path().read_text())
        return known if isinstance(known, dict) else {}
    except Exception:  # none yet, or unreadable: AutoTokenizer decides
        return {}


def _remember_class(key: str, name: str) -> None:
    """Record ``AutoTokenizer``'s class for the files of ``key`` (best effort: written aside and
    renamed, so a reader sees a whole file; a failure only costs the next load its import)."""
    path = _classes_path()
    with contextlib.suppress(Exception):
        known = _known_classes()
        if known.get(key) == name:
            return
        known[key] = name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's own template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; pass plain prompts instead of chat messages")
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)
