"""What the embedded server checks of a /generate request beyond its types (each failure names
its field, SGLang's rules where it has them: the context length, the vocabulary), and SGLang's
batch form (``input_ids`` a list of lists, ``text`` a list) as one request per input."""

from __future__ import annotations

from typing import Any

import msgspec

from areal_jax.inference.types import FLOAT32_MAX
from rollout_bridge import protocol as P

BATCH_PER_INPUT = ("sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num")
"""Fields a /generate batch may give as a list, one entry per input; any other is shared."""


def decode_generate(body: bytes) -> P.GenerateReqInput | list[P.GenerateReqInput]:
    """A /generate body: one request, or SGLang's batch form (``input_ids`` a list of token-id
    lists, or ``text`` a list of strings) as one request per input, in order. In a batch each
    field of ``BATCH_PER_INPUT`` is one value for every input or a list with one per input
    (``rid`` only a list: rids are unique). A batch with ``stream`` streams its inputs' events
    interleaved, each with its input's ``index``, as SGLang does."""
    try:
        return P.decode(body, P.GenerateReqInput)
    except P.ProtocolError as e:
        try:
            raw = msgspec.json.decode(body)
        except msgspec.DecodeError:
            raise e from None
        if not isinstance(raw, dict):
            raise
        ids, text = raw.get("input_ids"), raw.get("text")
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            return _batch_members(raw, "input_ids", "text")
        if isinstance(text, list):
            return _batch_members(raw, "text", "input_ids")
        raise


def _batch_members(raw: dict[str, Any], key: str, other: str) -> list[P.GenerateReqInput]:
    inputs = raw[key]
    n = len(inputs)
    if not n:
        raise P.ProtocolError(key, "an empty batch; send at least one input")
    if raw.get(other) is not None:
        raise P.ProtocolError(other, "send either text or input_ids, not both")
    per: dict[str, list[Any]] = {}
    for name in BATCH_PER_INPUT:
        value = raw.get(name)
        if isinstance(value, list):
            if len(value) != n:
                raise P.ProtocolError(name, f"has {len(value)} entries for a batch of {n} inputs; give one per "
                                    f"input{'' if name == 'rid' else ', or one value for all'}")
            per[name] = value
        elif name == "rid" and value is not None:
            raise P.ProtocolError("rid", f"a batch of {n} inputs needs a list of {n} rids (rids are unique), or none")
    members = []
    for i in range(n):
        member = {**raw, key: inputs[i], **{name: v[i] for name, v in per.items()}}
        try:
            members.append(msgspec.convert(member, P.GenerateReqInput))
        except msgspec.ValidationError as e:
            raise P.field_error(e, P.GenerateReqInput, f" (batch input {i})") from None
    return members


def validate_generate(req: P.GenerateReqInput, *, vocab_size: int, context_length: int) -> None:
    """Checks beyond types; each failure names its field. ``input_ids`` must be set by now."""
    sp = req.sampling_params
    ids = req.input_ids
    if ids is None or len(ids) == 0:
        raise P.ProtocolError("input_ids", "empty prompt; send at least one token id (or non-empty text)")
    bad = next((t for t in ids if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise P.ProtocolError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    if not 0 <= sp.temperature <= FLOAT32_MAX:  # NaN and what float32 cannot hold too
        raise P.ProtocolError("sampling_params.temperature",
                              f"must be a number >= 0 and <= {FLOAT32_MAX:.3g}, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise P.ProtocolError("sampling_params.top_p", f"must be in (0, 1], got {sp.top_p}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise P.ProtocolError("sampling_params.top_k", f"must be -1 (all) or >= 1, got {sp.top_k}")
    if sp.n != 1:
        raise P.ProtocolError("sampling_params.n", "only n=1 is served; send n requests with their own rids")
    if sp.stop:
        raise P.ProtocolError("sampling_params.stop", "stop strings are not supported; use stop_token_ids")
    for name, neutral in (("min_p", 0.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                          ("repetition_penalty", 1.0), ("min_new_tokens", 0)):
        if getattr(sp, name) != neutral:
            raise P.ProtocolError(f"sampling_params.{name}", f"not supported by this server (only {neutral})")
    for t in sp.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise P.ProtocolError("sampling_params.stop_token_ids", f"token id {t} is outside [0, {vocab_size})")
    if len(ids) >= context_length:  # SGLang's rule and words (TokenizerManager._validate_one_request)
        raise P.ProtocolError("input_ids", f"The input ({len(ids)} tokens) is longer than the model's context "
                            f"length ({context_length} tokens).")
    if sp.max_new_tokens < 0:
        raise P.ProtocolError("sampling_params.max_new_tokens", f"must be >= 0, got {sp.max_new_tokens}")
    for name, accepted in P.UNSUPPORTED_AT_DEFAULT.items():
        value = getattr(req, name)
        if value is not None and not any(value == a and type(value) is type(a) for a in accepted):
            raise P.ProtocolError(name, f"not supported by this server; leave it out (got {value!r})")
    start = req.logprob_start_len
    if start is not None and start != -1 and not 0 <= start < len(ids):
        raise P.ProtocolError("logprob_start_len", f"must be -1 or in [0, {len(ids)}) for a prompt of {len(ids)} "
                            f"tokens, got {start}")
    if req.top_logprobs_num is not None and req.top_logprobs_num < 0:
        raise P.ProtocolError("top_logprobs_num", f"must be >= 0, got {req.top_logprobs_num}")
    if not req.return_logprob:
        for name, unset in (("logprob_start_len", (None, -1)), ("top_logprobs_num", (None, 0)),
                            ("return_text_in_logprobs", (None, False))):
            if getattr(req, name) not in unset:
                raise P.ProtocolError(name, "needs return_logprob: true")
    if len(ids) + sp.max_new_tokens >= context_length:  # SGLang's: the total stays below the context length
        raise P.ProtocolError(
            "sampling_params.max_new_tokens",
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {len(ids) + sp.max_new_tokens} tokens: {len(ids)} tokens from the input "
            f"messages and {sp.max_new_tokens} tokens for the completion. Lower max_new_tokens to at most "
            f"{context_length - len(ids) - 1}.")
