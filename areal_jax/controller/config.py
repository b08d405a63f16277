"""``RolloutConfig``: the rollout room of the run config: where answers come from, how they are
sampled, which workflow turns prompts into groups, and how far rollout may run ahead."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollout_bridge.sglang_launch import SGLangOptions
from sharding import MeshConfig


@dataclass
class LocalRolloutConfig:
    """Where the in-process engine of ``rollout.backend: local`` runs, beside the trainer."""

    placement: Literal["shared", "split"] = "shared"
    """``shared``: on the trainer's devices and mesh, taking turns; a weight update hands the
    engine the trainer's params, with no copy where dtypes and layouts match. ``split``: the last
    ``engine_devices`` of this process's devices generate while the others train (``mesh`` then
    applies to the trainer's devices); a weight update reshards device to device. With several
    processes either works, each host's engine on that host's own devices (``split``: its
    engine share; the trainer's mesh spans every host's trainer share)."""
    engine_devices: int | None = None
    """With ``split``: how many devices generate; None: half of them. It and the number left to
    train must divide one another (the handover copies whole shards between the two groups)."""
    engine_mesh: MeshConfig = field(default_factory=lambda: MeshConfig(data=1, fsdp=1, tensor=-1))
    """With ``split``: the engine's mesh over its devices (``tensor``: heads and MLP columns split;
    ``data``: KV slots split)."""
    host: str | None = None
    """With several processes (a pod): the address this host's engine listens on and process 0
    reaches it at (every host serves its engine over HTTP, see ``rollout_bridge/hosts.py``; each
    host passes its own, ``rollout.local.host=10.0.0.5``). None: the address of the interface that
    reaches the ``jax.distributed`` coordinator."""


@dataclass
class RolloutConfig:
    """Rollout servers, sampling, the workflow and the staleness bound."""

    backend: Literal["embedded", "sglang", "servers", "local"] = "embedded"
    """``embedded``: start ``num_servers`` of our JAX servers as child processes; ``sglang``:
    start ``num_servers`` real SGLang servers (``areal-jax[sglang]``, GPU; options in ``sglang``;
    weights go over disk); ``servers``: use the running servers (ours or SGLang) at
    ``servers``; ``local``: one engine inside the trainer's process (a TPU host, a notebook), no
    HTTP, weights handed over on device; sized by ``server_args`` and placed by ``local``. With
    several processes (a pod), one such engine per host, each served over HTTP by its own process
    and given each version from that process's own gathers (``rollout_bridge/hosts.py``)."""
    num_servers: int = 1
    """Servers to start (``embedded`` and ``sglang``)."""
    server_devices: list[int] = field(default_factory=list)
    """The devices of this host that the started servers get, shared equally among them; the
    trainer keeps the others (GPU ordinals, TPU chips, or CPU cores for embedded servers on
    CPU). Empty: no split, every process sees every device."""
    device_platform: Literal["auto", "cpu", "gpu", "tpu"] = "auto"
    """What ``server_devices`` numbers; ``auto``: GPU for ``sglang``, else this host's
    accelerator (CPU when it has none)."""
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    """How each server of ``backend: sglang`` starts (tensor parallelism, memory, dtype)."""
    servers: list[str] = field(default_factory=list)
    """``host:port`` or URLs of running servers, with ``backend: servers``."""
    api_key: str | None = None
    """Bearer key the servers want, if any."""
    server_args: list[str] = field(default_factory=list)
    """Extra ``areal-jax serve`` flags for embedded servers, e.g. ``["--max-running-requests", "64"]``;
    they size the in-process engine of ``backend: local`` too (but for ``--tp-size``/``--dp-size``).
    A run's servers skip the start-up compile of every step shape (they compile what the run
    uses, on first use); ``"--server-warmup"`` here asks for it."""
    local: LocalRolloutConfig = field(default_factory=LocalRolloutConfig)
    """Placement of the in-process engine, with ``backend: local``."""
    startup_timeout_s: float = 300.0
    """How long to wait for embedded servers to answer ``/health``."""
    max_server_restarts: int = 3
    """Embedded servers that die are started again, this many times over the run in all; their
    requests move to the others meanwhile, and the client takes a restarted server back once it
    holds the current weights (at once after a disk push, else at the next push). One more death
    stops the run. 0: the first death stops it."""
    workflow: str = "single_turn"
    """``single_turn``, ``multi_turn``, ``agentic``, or a user's ``async def episode(client, row)``
    by import path (``my_pkg.flows:episode``)."""
    workflow_options: dict[str, Any] = field(default_factory=dict)
    """The workflow's own options (``max_turns``, ``turn_discount``, ``feedback``, ``agent``, ...)."""
    group_size: int = 8
    """Answers per prompt (n): one group, normalised together by group-relative estimators."""
    max_new_tokens: int = 256
    """The most tokens one answer may have (SGLang's ``max_new_tokens``)."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same (``train.temperature`` must match)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this (1: all)."""
    top_k: int = -1
    """Sample among the ``top_k`` most likely tokens; -1: all of them."""
    stop_token_ids: list[int] | None = None
    """Token ids that end an answer besides the model's end-of-sequence ones."""
    ignore_eos: bool = False
    """Generate every answer to ``max_new_tokens``, past end-of-sequence tokens (SGLang's
    ``ignore_eos``): fixed-length answers, for benchmarks and length-controlled tasks."""
    mode: Literal["async", "sync"] = "async"
    """``async``: rollout keeps generating while the trainer trains (AReaL). ``sync``: generate a
    batch, stop, train, update the weights, repeat (same code path, ``max_staleness`` forced to 0)."""
    max_staleness: int = 2
    """eta: no trained token is more than this many policy versions older than the trainer."""
    max_concurrent_rollouts: int | None = None
    """Cap on groups in flight; None: ``(max_staleness + 1) * batch_size``."""
    filter_uniform_reward: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (they carry no signal)."""
    failure_patience: int | None = None
    """Episodes failing in a row (the workflow raised, or returned no trajectory) that end the
    run, with the first one's traceback; fewer are counted (``failed``), logged and skipped.
    None: ``max(50, 4 * batch_size)``."""
    weight_sync: Literal["http", "disk"] = "http"
    """``http``: stream buckets to our servers; ``disk``: write a versioned HF checkpoint and call
    ``/update_weights_from_disk`` (SGLang, or any server on a shared filesystem). ``backend:
    local`` ignores it: its weights go device to device."""
    weights_dir: str | None = None
    """With ``weight_sync: disk``: where each version is written, a path or URL every server can
    read (NFS, ``gs://bucket/run/weights`` with ``areal-jax[gcs]``); None: ``<run dir>/weights``."""
    servers_weights_dir: str | None = None
    """The same directory as the servers name it, when that differs from ``weights_dir`` (the
    trainer writes ``gs://bucket/run/weights``, the GPU hosts read it through a gcsfuse mount at
    ``/mnt/gcs/run/weights``); each version's path is sent to the servers under this name.
    None: ``weights_dir``."""
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    """How servers pause for a weight update; ``abort`` ends in-flight requests and the client
    resumes them under the new weights (interruptible rollout). ``retract`` keeps them in the
    server's queue, which prefills them again under the new weights (no round trip through the
    client; SGLang servers need a version whose ``pause_generation`` takes a mode): on the
    ``--long-tail`` bench an ``abort`` step took 1.04 ± 0.25x a ``retract`` step over six seeds,
    paired, since the client re-sends the answers a pause returns empty at once (1.27x before;
    docs/results.md). ``in_place`` keeps the stale KV (not AReaL's semantics)."""
    interruptible: bool = True
    """``True``: a weight update pauses the servers (``pause_mode``) at once. ``False``: rollout
    stops starting episodes and the update waits for the ones in flight to finish (the baseline
    that interruptible generation is measured against; async mode only)."""

    batch_group_requests: bool = True
    """``single_turn`` asks for a group's answers together: one /generate per group in SGLang's
    batch form (``input_ids`` a list of lists) to one server, re-sending only the unfinished
    answers after an abort. False: one request per answer, as AReaL's client sends them."""
    push_before_pause: bool = True
    """Async mode, HTTP pushes to our own servers: the servers take each new version while they
    keep generating, then each pauses (``pause_mode``), swaps it in and continues within one
    ``/commit_weights`` call, so a pause lasts about a decode step, not a transfer and three round
    trips; tokens made meanwhile carry the version before. False: pause, push, continue (AReaL's
    order; SGLang servers, disk pushes and ``max_staleness`` 0 with ``overlap_weight_push``,
    whose next batch waits for the pause, always use it)."""
    overlap_weight_push: bool = True
    """Async mode: the push of version ``v`` runs while the batch after it trains, instead of
    before it. The controller counts ``v`` at once; tokens made under the version before until
    the servers pause carry that version, so the staleness bound holds (with ``max_staleness``
    0 the next batch waits for the pause, else those samples could not be trained). The trainer
    keeps the pushed params alive until the push ends: one more copy of them in memory
    meanwhile. Runs of several trainer processes push in line."""

    def __post_init__(self) -> None:
        self._check_values()
        if self.group_size < 1:
            raise ValueError(f"rollout.group_size must be >= 1, got {self.group_size}")
        if self.backend == "servers" and not self.servers:
            raise ValueError("rollout.backend=servers needs rollout.servers=[host:port, ...]")
        if self.temperature < 0:
            raise ValueError(f"rollout.temperature must be >= 0, got {self.temperature}")
        if self.max_server_restarts < 0:
            raise ValueError(f"rollout.max_server_restarts must be >= 0, got {self.max_server_restarts}")
        if self.backend == "sglang" and self.weight_sync != "disk":
            raise ValueError("rollout.backend=sglang moves weights through disk: set rollout.weight_sync=disk "
                             "(SGLang reads a versioned HF checkpoint with /update_weights_from_disk)")
        if self.server_devices and self.backend not in ("embedded", "sglang"):
            raise ValueError(f"rollout.server_devices splits a host between the trainer and the servers it starts; "
                             f"rollout.backend={self.backend} starts none (use embedded or sglang, or clear it)")
        if (self.backend == "sglang" and self.server_devices
                and len(self.server_devices) != self.num_servers * self.sglang.tp_size):
            raise ValueError(f"rollout.server_devices has {len(self.server_devices)} GPUs for {self.num_servers} "
                             f"SGLang server(s) of rollout.sglang.tp_size={self.sglang.tp_size}: give "
                             f"num_servers x tp_size = {self.num_servers * self.sglang.tp_size}")

    def _check_values(self) -> None:
        """Ranges and combinations a server, the controller or the trainer would otherwise refuse
        (or ignore) only after the run started."""
        from areal_jax.controller.workflow import check_workflow_options

        at_least = {"max_staleness": 0, "max_new_tokens": 1, "num_servers": 1, "max_concurrent_rollouts": 1,
                    "failure_patience": 1}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"rollout.{name} must be >= {low}, got {value}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"rollout.top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.stop_token_ids and min(self.stop_token_ids) < 0:
            raise ValueError(f"rollout.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        if self.startup_timeout_s <= 0:
            raise ValueError(f"rollout.startup_timeout_s must be > 0, got {self.startup_timeout_s}")
        if self.filter_uniform_reward and self.group_size == 1:
            raise ValueError("rollout.filter_uniform_reward drops groups whose rewards are all equal, and with "
                             "rollout.group_size 1 every group is one answer, so it would drop every group: raise "
                             "group_size or set filter_uniform_reward=false")
        self.workflow_options = check_workflow_options(self.workflow, dict(self.workflow_options))

    def platform(self) -> str:
        """What ``server_devices`` numbers (``device_platform`` with ``auto`` resolved)."""
        if self.device_platform != "auto":
            return self.device_platform
        if self.backend == "sglang":
            return "gpu"
        from rollout_bridge.placement import detect_platform

        return detect_platform()

    @property
    def effective_max_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    def sampling_params(self) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                              "top_p": self.top_p, "top_k": self.top_k}
        if self.stop_token_ids:
            sp["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            sp["ignore_eos"] = True
        return sp
