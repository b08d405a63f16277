"""The embedded server's state and the reply helpers every route module shares: one
``ServerState`` per app under ``STATE``, JSON and error replies, and the engine's failed
requests as HTTP errors. Route modules (``generate_api``, ``weights_api``, ``openai_api``) and
the app (``server``) import it; it imports none of them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from areal_jax.inference.types import GenerateOutput
from rollout_bridge import protocol as P

DEFAULT_WEIGHT_VERSION = "default"
"""SGLang's label for the weights a server started with (its ``--weight-version`` default)."""
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024**2
DEFAULT_MAX_BODY_BYTES = 4 * 1024**3
DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S = 300.0
SHUTDOWN_MESSAGE = "server shutting down"
WEIGHT_UPDATE_MODES = ("swap", "drain")
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
"""The endpoints whose requests a draining weight update waits for (``ServerState.generation``)."""


@dataclass
class ServerState:
    engine: Any
    tokenizer: Any
    api_key: str | None
    model_path: str = ""
    tokenizer_path: str = ""
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    health_timeout_s: float = 30.0
    staged: Any = None
    """The weight transfer being received (``weights_api``)."""
    held: Any = None
    """A finished transfer sent with ``hold``: weights built, waiting for ``/commit_weights``."""
    weight_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    weight_version: str = DEFAULT_WEIGHT_VERSION
    """The label served now; any string."""
    labels: dict[int, str] = field(default_factory=dict)
    """Engine version -> the label it was served under, for the spans of answers in flight."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra ``internal_states`` of /get_server_info (tp_size, dp_size, ...)."""
    metrics_mark: tuple[float, int] = (0.0, 0)
    """(time, generated tokens) at the last /metrics scrape, for its tokens/s."""
    shutting_down: bool = False
    ready: bool = True
    """False while the engine compiles its steps at start-up: /health answers 503 until then."""
    warmup: dict[str, Any] = field(default_factory=dict)
    """How the start-up compilation went (``shapes``, ``seconds``, or ``error``)."""
    weight_roots: tuple[str, ...] = ()
    """Resolved directories (or URL prefixes) ``/update_weights_from_disk`` may load from."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Bound on a JSON request body (413 past it)."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Bound on one weight bucket's body (413 past it)."""
    weight_transfer_timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S
    """A staged weight transfer with no bucket for this long is dropped, freeing its tensors."""
    incremental_streaming_output: bool = False
    """A streamed /generate sends each event's new text, tokens and logprobs only (SGLang's
    ``--incremental-streaming-output``); without it every event repeats the answer so far, as
    stock SGLang does by default."""

    weight_update_mode: str = "swap"
    """How a weight update meets the requests in flight. ``swap`` (default, what asynchronous RL
    wants): the new weights go in between two steps and the requests go on under them, their
    replies saying which tokens each version sampled. ``drain`` (SGLang's model-update lock):
    new requests wait, the update waits for those in flight to finish, so no answer crosses
    versions; a paused server is not drained (what it holds would never finish), as in SGLang."""
    generating: int = 0
    """Generation requests admitted past the drain gate and not finished."""
    draining: bool = False
    gate: asyncio.Condition = field(default_factory=asyncio.Condition)

    @contextlib.asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        """Around one generation request: waits while an update drains (``drain`` mode)."""
        async with self.gate:
            await self.gate.wait_for(lambda: not self.draining)
            self.generating += 1
        try:
            yield
        finally:
            async with self.gate:
                self.generating -= 1
                self.gate.notify_all()

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Around one weight change: in ``drain`` mode on a running server, new requests wait and
        the change waits for those in flight (SGLang's writer lock); else nothing is held."""
        if self.weight_update_mode != "drain":
            yield
            return
        async with self.gate:
            self.draining = True
            try:
                await self.gate.wait_for(lambda: self.generating == 0 or self.paused)
            except BaseException:
                self.draining = False
                self.gate.notify_all()
                raise
        try:
            yield
        finally:
            async with self.gate:
                self.draining = False
                self.gate.notify_all()

    async def wake_gate(self) -> None:
        """A pause changes what a drain waits for: let it look again."""
        async with self.gate:
            self.gate.notify_all()

    @property
    def paused(self) -> bool:
        """The engine is paused (by ``/pause_generation``, or for a commit's swap): the engine's
        own state, so that it cannot disagree with what the engine does."""
        return self.engine.paused is not None

    def label_of(self, version: int) -> str:
        return self.labels.get(version, self.weight_version)

    def relabel(self, label: str) -> None:
        self.weight_version = label
        self.labels[self.engine.version] = label
        while len(self.labels) > 1024:  # only versions still in flight matter
            del self.labels[next(iter(self.labels))]


STATE = web.AppKey("state", ServerState)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=P.encode(obj), status=status, content_type="application/json")


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    resp = json_response({"error": {"message": message, "code": status}}, status)
    resp.headers.update(headers or {})
    return resp



class EngineFailed(RuntimeError):
    """The engine failed a request (its step raised): HTTP ``status`` (5xx) with the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def checked(out: GenerateOutput) -> GenerateOutput:
    """``out``, unless the engine ended it with an error (an abort with a 5xx ``status_code``)."""
    code = int((out.finish_reason or {}).get("status_code") or 0)
    if code >= 500:
        raise EngineFailed(code, str(out.finish_reason.get("message")))
    return out

