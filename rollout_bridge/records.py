"""What a rollout client knows of each inference server (``ServerRecord``: its address, health,
the policy version it holds by the client's record, its labels and pause state), the client's
settings (``ClientConfig``) and its errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KEEPING_PAUSE_MODES = ("in_place", "retract")
"""Pause modes that keep the requests running on the server (SGLang's): a weight change under one
can give a request tokens of both weights."""


class RolloutError(RuntimeError):
    """A generation or control call that cannot succeed; the message says which server and why."""


class AllServersDownError(RolloutError):
    pass


class WeightUpdateError(RolloutError):
    """A weight update some servers refused; ``failed`` maps each one's URL to its answer."""

    def __init__(self, message: str, failed: dict[str, str] | None = None):
        super().__init__(message)
        self.failed = dict(failed or {})


@dataclass
class ClientConfig:
    """Timeouts and retry policy of ``HttpRolloutClient``."""

    generate_timeout_s: float = 3600.0
    """Upper bound on one /generate call (one attempt, not the whole resumed answer)."""
    control_timeout_s: float = 60.0
    """Pause, continue, abort, flush, info, health."""
    weight_timeout_s: float = 1800.0
    """/update_weights_from_disk and each bucket of /update_weights_from_tensor."""
    connect_timeout_s: float = 10.0
    health_interval_s: float = 5.0
    """Period of the background health check started by ``start()``."""
    all_down_wait_s: float = 30.0
    """How long a request waits for some server to come back before ``AllServersDownError``."""
    max_resends: int = 1000
    """Bound on re-sends of one request (aborts, failovers and refusals by a full server)."""
    max_error_resends: int = 3
    """Re-sends of one request after server errors (a 5xx, or an abort with a 5xx status); one
    more error raises ``RolloutError`` with the server's message."""
    error_backoff_s: float = 0.5
    """Wait before re-sending after a server error; doubles with each further error (up to 30 s)."""
    max_connections_per_server: int = 512
    """Most concurrent /generate connections to one server; more requests wait for one. Control
    calls use their own connections, so a pause is never stuck behind generations."""
    busy_backoff_s: float = 1.0
    """Wait after a 503 (full queue) when the server gives no Retry-After; doubles while it stays
    full, up to 8x."""
    batch_requests: bool = True
    """``generate_many`` asks for a group's answers in one /generate (SGLang's batch form), not
    one request per answer: one HTTP round trip per group on both sides."""
    initial_version: int = 0
    """The policy version every server holds when the client starts (the weights it was launched with)."""


@dataclass
class ServerRecord:
    """One server as the client knows it."""


    url: str
    version: int = 0
    """The policy version this server holds, by the client's record."""
    healthy: bool = True
    last_error: str = ""
    inflight: set[str] = field(default_factory=set)
    labels: dict[str, int] = field(default_factory=dict)
    """weight_version labels this server reported or was given -> the policy version they stand for."""
    keeps_labels: bool = False
    """The server confirmed that it took a label we gave (ours and SGLang >= 0.5 do): a weight
    update's reply said so, or it later reported such a label. Only then can an older label mean
    a restart; a server that ignores labels always reports its first one."""
    first_label: str | None = None
    """The label it reported at first contact (its launch weights), not one this client gave."""
    paused: bool = False
    """The server is paused, by what it last answered or reported. While the fleet runs, a paused
    server takes no requests: they would wait there until someone continues it."""
    pause_mode: str | None = None
    """The mode of this client's pause in effect on it (None while it runs)."""
    updates: int = 0
    """Weight changes this client began on it (a push, a load, a relabel): a reply to a request
    sent before the last one began may hold tokens of the weights before it."""
    updating: int = 0
    """Weight changes in progress on it: a request sent now may run under either weights."""
    continues: int = 0
    """``/continue_generation`` calls this client sent it: a request held by a pause runs only
    after one."""
    free_update: int = -1
    """``updates`` at the last change begun while this client had not paused it: a request that
    reached it after that change began may have run under the new weights with no continue."""
    kept_update: int = -1
    """``updates`` at the last change made while a pause kept its requests (``in_place``,
    ``retract``): a request that ran before it may hold tokens of both weights."""


def reply_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message"))
        if "message" in body:
            return str(body["message"])
    return str(body)[:500]


def confirms_label(reply: Any, label: str) -> bool:
    """Whether a weight-update reply says the server now reports ``label`` (our server: its
    ``weight_version``; SGLang: ``new_version`` or "Weight version updated to ..." in the message)."""
    if not isinstance(reply, dict):
        return False
    return (reply.get("weight_version") == label or reply.get("new_version") == label
            or f"Weight version updated to {label}" in str(reply.get("message", "")))
