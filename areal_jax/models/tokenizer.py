"""Tokenizer and chat template of a model directory, through ``transformers``' fast tokenizer.

Nothing here tokenizes by itself: we load what the ecosystem's libraries load, so our token ids
and chat formatting are the ones SGLang and ``transformers`` produce for the same directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | os.PathLike) -> Any:
    """The ``transformers`` tokenizer saved in ``model_dir`` (tokenizer.json and its config)."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").exists() and not (model_dir / "tokenizer_config.json").exists():
        raise FileNotFoundError(
            f"{model_dir}: no tokenizer.json or tokenizer_config.json; copy the tokenizer files "
            "of the base model into this directory"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def encode_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's own template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; pass plain prompts instead of chat messages")
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)
