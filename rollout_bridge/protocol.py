"""The subset of SGLang's native HTTP API that areal-jax speaks, defined once.

Both sides use these types: the embedded JAX server decodes requests and encodes replies with
them, and the rollout client encodes requests and decodes replies, whether the server is a real
SGLang or ours. JSON field names, types and defaults are SGLang's (0.5.x, ``io_struct`` and the
``sglang.api.v1`` schema). Two things are ours:

* ``meta_info.weight_versions``: spans ``[{"version": "3", "start": 0, "end": 7}, ...]`` over
  ``output_ids`` (half-open) for an answer that crossed a weight update. SGLang's own schema has
  the field. A version here, like ``weight_version`` everywhere, is an opaque label: stock SGLang
  says ``"default"`` unless told otherwise, and the client never parses it into a number.
* ``/update_weights_from_tensor`` with ``Content-Type: application/octet-stream``: the body is
  one bucket of tensors in safetensors format (any dtype, bfloat16 included), the query string
  carries the transfer's ``weight_version``, ``transfer_id``, ``bucket`` index and ``last``,
  and ``layout=native`` when the kernels are in our own ``[in, out]`` layout rather than HF's.
  Buckets are staged by the server and applied together, atomically, when the one marked
  ``last`` arrives; with ``hold`` as well, the server builds them but serves them only when
  ``POST /commit_weights`` (``{"transfer_id", "weight_version", "pause_mode"}``) names the
  transfer, pausing (``pause_mode``) and continuing around the swap itself.

Decoding raises ``ProtocolError`` whose message names the field; servers answer it with 400.
What a /generate request must satisfy beyond its types, and its batch form, are in
``rollout_bridge.validation``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from areal_jax.models.safetensors_codec import safetensors_views

CONTEXT_UNLIMITED_TOP_K = 1 << 30
"""SGLang's spelling of "top_k disabled" in its schema; -1 means the same."""


class ProtocolError(ValueError):
    """A request that breaks the protocol; ``field`` is its JSON path, e.g. ``sampling_params.top_p``."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- /generate ---------------------------------------------------------------------------------

class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``sampling_params`` of /generate; an unknown key is a 400 naming it."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or SGLang's 1 << 30) keeps the whole vocabulary."""
    min_p: float = 0.0
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    """Stop strings: accepted for compatibility; only an empty value is supported here."""
    ignore_eos: bool = False
    n: int = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0


class GenerateReqInput(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Body of POST /generate: one request (``decode_generate`` splits SGLang's batch form into these).

    Every field of SGLang's request schema is here: the ones this server implements, then the
    ones it does not, which are refused (``validate_generate``) unless left at their default. A
    key that is not in SGLang's schema is refused too.
    """

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    """First prompt position whose logprob is returned (``input_token_logprobs``); None or -1:
    none. Position 0 has no logprob (null)."""
    top_logprobs_num: int | None = None
    """Also return the logprobs of this many likeliest tokens at each output position
    (``output_top_logprobs``) and, with ``logprob_start_len``, each prompt position."""
    return_text_in_logprobs: bool | None = None
    """Fill the third element of each logprob entry with the token's text."""
    return_prompt_token_ids: bool = False
    rid: str | None = None
    stream: bool = False
    # SGLang's other fields: accepted only at their defaults (see UNSUPPORTED_AT_DEFAULT).
    token_ids_logprob: Any = None
    return_hidden_states: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    image_data: Any = None
    mm_hashes: Any = None
    video_data: Any = None
    audio_data: Any = None
    extra_key: Any = None
    priority: Any = None
    cache_salt: Any = None
    require_reasoning: Any = None
    lora_path: Any = None
    session_params: Any = None
    kv_hints: Any = None
    routing_key: Any = None
    max_thinking_tokens: Any = None
    session_id: Any = None
    custom_logit_processor: Any = None
    custom_labels: Any = None
    images_config: Any = None
    routed_experts_start_len: Any = None
    return_sampling_mask: Any = None
    modalities: Any = None


UNSUPPORTED_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "token_ids_logprob": (), "return_hidden_states": (False,), "bootstrap_host": (), "bootstrap_port": (),
    "bootstrap_room": (), "bootstrap_pair_key": (), "decode_tp_size": (), "routed_dp_rank": (),
    "disagg_prefill_dp_rank": (), "image_data": ([],), "mm_hashes": ([],), "video_data": ([],), "audio_data": ([],),
    "extra_key": (), "priority": (), "cache_salt": (), "require_reasoning": (False,), "lora_path": (),
    "session_params": (), "kv_hints": (), "routing_key": (), "max_thinking_tokens": (), "session_id": (),
    "custom_logit_processor": (), "custom_labels": ({},), "images_config": (), "routed_experts_start_len": (0,),
    "return_sampling_mask": (False,), "modalities": ([],),
}
"""SGLang request fields this server does not implement -> the values besides null it accepts
as "not used" (AReaL sends ``image_data: []``)."""


class WeightVersionSpan(msgspec.Struct, kw_only=True):
    version: str
    start: int
    end: int


class MetaInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Always sent, as SGLang does (0 included): prompt tokens read from another request's KV."""
    weight_version: str | None = None
    weight_versions: list[WeightVersionSpan] = msgspec.field(default_factory=list)
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    """``[logprob, token_id, text or null]`` per output token."""
    input_token_logprobs: list[tuple[float | None, int, str | None]] | None = None
    """Per prompt position from ``logprob_start_len`` (position 0: logprob null)."""
    output_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    input_top_logprobs: list[list[tuple[float, int, str | None]] | None] | None = None
    e2e_latency: float | None = None


class GenerateReqOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Reply of /generate, and each ``data:`` event of a streamed one (the answer so far, or with
    ``incremental_streaming_output`` what is new since the previous event)."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    prompt_token_ids: list[int] | None = None
    index: int | None = None
    """A streamed batch's events: the input this event answers (SGLang interleaves them)."""


# --- control endpoints ---------------------------------------------------------------------------

class AbortReqInput(msgspec.Struct, kw_only=True):
    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(msgspec.Struct, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskReqInput(msgspec.Struct, kw_only=True):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightVersionReqInput(msgspec.Struct, kw_only=True):
    new_version: str
    abort_all_requests: bool = True


class UpdateWeightsResult(msgspec.Struct, kw_only=True):
    """Reply of the weight endpoints (SGLang answers HTTP 400 with success false on failure)."""

    success: bool
    message: str = ""
    weight_version: str | None = None
    num_paused_requests: int = 0
    """SGLang's field: requests held paused in place across the update (none here: the update
    swaps the weights between steps, see ``weights_api``)."""


class UpdateWeightsFromTensorReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's JSON form of /update_weights_from_tensor: ``serialized_named_tensors`` holds, per
    tensor-parallel rank, (name, tensor) pairs pickled by torch's multiprocessing serializer
    (CUDA IPC handles for a trainer on the same machine). Checked for its shape, then refused:
    this server unpickles nothing (``WEIGHTS_JSON_REFUSED``)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None


class UpdateWeightsFromDistributedReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /update_weights_from_distributed: tensors broadcast over a torch.distributed
    (NCCL) group set up by /init_weights_update_group. Checked for its shape, then refused."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class InitWeightsUpdateGroupReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /init_weights_update_group (an NCCL group with the trainer). Checked, then refused."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


WEIGHTS_JSON_REFUSED = {
    "tensor": "the JSON form carries pickled torch tensors (CUDA IPC handles) and this server unpickles "
              "nothing; send each bucket as safetensors bytes with Content-Type: application/octet-stream "
              "(query: weight_version, transfer_id, bucket, last; HttpRolloutClient.push_tensor_bucket), "
              "or load a checkpoint with /update_weights_from_disk",
    "distributed": "this JAX server joins no torch.distributed (NCCL) group, so there is nothing to receive "
                   "the broadcast on; push safetensors buckets to /update_weights_from_tensor "
                   "(Content-Type: application/octet-stream) or load a checkpoint with /update_weights_from_disk",
}
"""Why each JSON weight form is refused, and what to send instead."""


class TensorBucketParams(msgspec.Struct, kw_only=True):
    """Query string of our bucketed /update_weights_from_tensor (body: safetensors bytes)."""

    weight_version: str
    transfer_id: str
    bucket: int
    """0, 1, 2, ... in order; a gap or repeat is a 400."""
    last: bool = False
    """The final bucket: apply everything staged under ``transfer_id`` as ``weight_version``."""
    hold: bool = False
    """With ``last``: build the new weights but go on serving the old ones until
    ``/commit_weights`` names this transfer, so a server keeps generating while a version
    travels and stops only for the swap."""
    flush_cache: bool = True
    abort_all_requests: bool = False
    layout: Literal["hf", "native"] = "hf"
    """``hf``: HF tensors (``[out, in]`` weights); ``native``: the same names with our own
    ``[in, out]`` kernels, which neither side transposes. One transfer keeps one layout."""
    partial: bool = False
    """With ``last``: the transfer sends only some of the model's tensors on purpose (the others
    keep their served values). Without it, a transfer whose tensors do not cover the whole model
    is refused at its last bucket, by the names missing, and nothing changes."""


class CommitWeightsReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of our ``/commit_weights``: serve the weights a transfer sent with ``hold``."""

    transfer_id: str
    weight_version: str
    flush_cache: bool = True
    pause_mode: Literal["abort", "retract", "in_place"] | None = None
    """Pause generation this way for the swap and continue right after, within this call, so
    the server stops only for the swap (an interruptible update without a round trip in
    between). None: swap between steps, requests in flight keep their KV; a server paused
    by ``/pause_generation`` stays paused either way."""


class ModelInfo(msgspec.Struct, kw_only=True):
    model_path: str
    tokenizer_path: str
    is_generation: bool = True
    weight_version: str | None = None
    served_model_name: str = ""
    preferred_sampling_params: dict[str, Any] | None = None


class ServerInfo(msgspec.Struct, kw_only=True):
    model_path: str
    tokenizer_path: str
    served_model_name: str
    max_context_length: int
    version: str
    host: str
    port: int
    internal_states: list[dict[str, Any]] = msgspec.field(default_factory=list)
    incremental_streaming_output: bool = False
    weight_update_mode: str = "swap"
    """``swap`` (updates go in between steps) or ``drain`` (they wait for the requests in flight)."""
    disaggregation_mode: str = "null"


# --- helpers shared by server and client ---------------------------------------------------------

_decoders: dict[type, msgspec.json.Decoder] = {}


def decode(body: bytes, cls: type) -> Any:
    """Decode a JSON body into ``cls``; a type or unknown-field error becomes ``ProtocolError``."""
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.json.Decoder(cls)
    try:
        return dec.decode(body or b"{}")
    except msgspec.ValidationError as e:
        raise field_error(e, cls) from None
    except msgspec.DecodeError as e:
        raise ProtocolError("body", f"not valid JSON ({e})") from None


def field_error(e: msgspec.ValidationError, cls: type, where: str = "") -> ProtocolError:
    """msgspec's "... - at `$.sampling_params`" as a ``ProtocolError`` naming the field."""
    msg = str(e)
    field = "body"
    if " - at `$." in msg:
        msg, path = msg.rsplit(" - at `$.", 1)
        field = path.rstrip("`")
    if "unknown field `" in msg:
        name = msg.split("unknown field `", 1)[1].split("`", 1)[0]
        field = f"{field}.{name}" if field != "body" else name
        msg = f"unknown parameter {name!r}; supported: {sorted(cls_fields(cls, field))}"
    return ProtocolError(field + where, msg)


def cls_fields(cls: type, field: str) -> tuple[str, ...]:
    if field.startswith("sampling_params"):
        return SamplingParams.__struct_fields__
    return getattr(cls, "__struct_fields__", ())


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def version_spans(labels: list[str]) -> list[WeightVersionSpan]:
    """Run-length spans of per-token version labels over ``output_ids``."""
    spans: list[WeightVersionSpan] = []
    for i, v in enumerate(labels):
        if spans and spans[-1].version == v:
            spans[-1].end = i + 1
        else:
            spans.append(WeightVersionSpan(version=v, start=i, end=i + 1))
    return spans


def span_labels(meta: dict[str, Any], n_tokens: int) -> list[str | None] | None:
    """Per-token version labels from a reply's ``weight_versions`` spans; None without spans."""
    spans = meta.get("weight_versions") or []
    if not spans:
        return None
    out: list[str | None] = [None] * n_tokens
    for s in spans:
        for i in range(max(0, int(s["start"])), min(n_tokens, int(s["end"]))):
            out[i] = str(s["version"])
    return out


# --- tensor buckets (the codec itself: ``areal_jax.models.safetensors_codec``) ---------------------

def decode_tensor_bucket(body: bytes) -> dict[str, np.ndarray]:
    """A pushed bucket's safetensors bytes -> arrays (views into ``body``)."""
    try:
        return safetensors_views(body)
    except ValueError as e:
        raise ProtocolError("body", str(e)) from None
