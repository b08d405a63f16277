"""Incremental detokenisation for streamed answers: each event decodes only a short window of
the newest tokens, so a streamed answer costs linear, not quadratic, time in its length.

The scheme is SGLang's detokenizer's (and vLLM's): keep two offsets into the answer's tokens,
``prefix`` (where the context window starts) and ``read`` (the tokens before it are emitted).
Each push decodes ``tokens[prefix:read]`` and ``tokens[prefix:]`` and emits the second's tail
past the first, unless it ends in U+FFFD (half of a multi-byte character: wait for the rest).
The window starts one emission back so that tokenizers whose decode depends on the token before
(a leading-space rule, byte-level pieces of one character) decode each token in context; the
emitted pieces join to ``tokenizer.decode(tokens)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns an answer's tokens, pushed a few at a time, into the text new with each push."""

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text_len = 0
        """Characters emitted so far (the OpenAI ``text_offset`` of the next piece)."""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Sequence[int], *, final: bool = False) -> str:
        """Add ``ids`` to the answer; return the text they complete. ``final``: the answer has
        ended, so a trailing half character is emitted as U+FFFD, as a full decode gives it."""
        self.ids.extend(ids)
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if not final and now.endswith(_REPLACEMENT):
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text_len += len(delta)
        return delta
