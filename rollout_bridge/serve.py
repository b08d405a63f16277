"""``areal-jax serve``: load a model directory and serve it on the embedded server, with SGLang's
flag names for the options it shares (``--tp-size``, ``--dp-size``, ``--chunked-prefill-size``,
``--max-queued-requests``, ``--random-seed``, ``--weight-version``, ``--context-length``, ...).
As in SGLang, the context length defaults to the model's ``max_position_embeddings`` and exceeds
it only when asked to explicitly.

With ``--tp-size`` / ``--dp-size`` above 1 the model is sharded over that many of the host's
devices (tensor axis: heads and MLP columns). Over ``--dp-size`` the paged KV cache runs as SGLang
does: one engine per data-parallel rank, each on its own ``--tp-size`` devices with its own page
pool, ``--max-running-requests`` and ``--max-total-tokens``, behind this one server
(``inference.replicas``); the slot cache instead splits its slots over a data axis of one mesh.

It listens on 127.0.0.1 unless ``--host`` says otherwise. ``--api-key`` guards every endpoint but
the health checks; ``--weight-roots`` bounds where ``/update_weights_from_disk`` may load from;
``--max-request-bytes`` / ``--max-weight-bucket-bytes`` bound request bodies (413 past them) and
``--weight-transfer-timeout`` drops a bucketed weight push that stops half-way.

SIGTERM shuts it down cleanly (requests in flight are answered with what they have), in every
phase, the start-up compilation included. Started by a ``ServerFleet`` (``AREAL_JAX_PARENT_PID``
set), it also shuts down so once its parent is gone. If its engine dies (a lane whose KV cache
cannot be re-allocated after a failed step), it answers 503 on ``/health``, fails its requests,
and exits with status 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rollout_bridge.launcher import PARENT_PID_ENV, process_age
from rollout_bridge.server import build_app, start_server
from rollout_bridge.state import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
    DEFAULT_WEIGHT_VERSION,
)

log = logging.getLogger("rollout_bridge.serve")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" only where the help does not say its default in words and there
    is one to show: no "(default: unbounded) (default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, False, ""):
            return text
        return super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("areal-jax serve", description="Serve a model over SGLang's HTTP API (native "
                                "/generate and the weight-update endpoints, plus OpenAI-compatible /v1/...)",
                                formatter_class=_HelpFormatter)
    p.add_argument("--model-path", required=True, help="HF model directory (config.json + safetensors)")
    p.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model path)")
    p.add_argument("--served-model-name", default="", help="model name in replies (default: the model path)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /health_generate")
    p.add_argument("--weight-roots", nargs="+", action="extend", default=None, metavar="DIR",
                   help="directories (or URL prefixes) /update_weights_from_disk may load from, symlinks resolved "
                        "(default: the directory that holds --model-path)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest JSON request body (/generate, /v1/..., control); bigger ones get 413")
    p.add_argument("--max-weight-bucket-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest /update_weights_from_tensor bucket (a tensor bigger than the pusher's bucket size "
                        "travels alone, so this must hold the largest tensor); bigger ones get 413")
    p.add_argument("--weight-transfer-timeout", type=float, default=DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
                   help="seconds an unfinished bucketed weight push may go without a bucket before it is dropped")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="parameter, compute and KV-cache dtype (default: the checkpoint's config)")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel devices (heads and MLP columns split)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="data-parallel ranks; with --kv-cache paged one engine per rank (each on --tp-size devices, "
                        "its own page pool), requests routed to the least loaded, as SGLang's --dp-size; with slots "
                        "one engine whose KV slots split over the ranks")
    p.add_argument("--max-running-requests", type=int, default=32,
                   help="most requests decoded at once (with --kv-cache slots: the KV slots, split over --dp-size; "
                        "paged: per data-parallel rank, as in SGLang)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="most requests waiting for a slot; more are refused with 503 (default: unbounded)")
    p.add_argument("--context-length", type=int, default=None,
                   help="most prompt + answer tokens per request (default: the model's max_position_embeddings)")
    p.add_argument("--allow-overwrite-longer-context-len", action="store_true",
                   help="allow a --context-length above the model's max_position_embeddings (SGLang's "
                        f"{LONGER_CONTEXT_ENV}=1 does the same)")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per KV page (SGLang's default is 1; pages of 16 keep the work lists short)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="tokens the KV pool holds, per data-parallel rank as in SGLang (its max_total_num_tokens; "
                        "default: sized from memory, at most --max-running-requests x --context-length; on a CPU "
                        "the ranks share the host's share)")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="share of device memory for weights and KV pool (default 0.85); on a CPU, which reports no "
                        "device memory, the share of available host memory the pool may take (default 0.25)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "native", "fa"],
                   help="paged attention (sglang-jax's values): 'fa' the maintained kernel (TPU ragged paged "
                        "attention; Pallas GPU paged attention for decode rows), 'native' the XLA gather path, "
                        "'auto' the kernel where it runs (TPU/GPU, bfloat16/float16, one device), else native")
    p.add_argument("--layer-layout", default="split", choices=["split", "stacked"],
                   help="the served layer weights: 'split', one array per layer, read in place by decode (the "
                        "fast layout); 'stacked', the trainer's layout, which an in-process trainer lends without "
                        "a copy when dtypes match, at a copy of each layer's weights per decode step (not an "
                        "SGLang flag)")
    p.add_argument("--kv-cache", default=None, choices=["paged", "slots"],
                   help="'paged': one page pool, admission by free pages; 'slots': one --context-length region per "
                        "running request (not an SGLang flag; default: paged, or $AREAL_JAX_KV_CACHE; slots over "
                        "--dp-size > 1)")
    p.add_argument("--chunked-prefill-size", type=int, default=1024,
                   help="prompt tokens per prefill call; longer prompts prefill in chunks (-1: never chunk)")
    p.add_argument("--random-seed", type=int, default=None,
                   help="seed of requests without sampling_seed (default: drawn at random at start)")
    p.add_argument("--weight-version", default=DEFAULT_WEIGHT_VERSION, help="label of the initial weights")
    p.add_argument("--skip-server-warmup", action="store_true",
                   help="start answering at once and compile each step shape when first needed (default: compile "
                        "every prefill and decode shape at start-up; /health answers 200 after)")
    p.add_argument("--compile-threads", type=int, default=None,
                   help="paged engine: threads that compile the step shapes not compiled yet in the background once "
                        "the engine starts (with --skip-server-warmup, or the in-process engine of rollout.backend "
                        "local), those the first requests need first; 0: each shape compiles at its first call, one "
                        "after another (not an SGLang flag; default: one per two cores, at most 8)")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="prefill every request, even one whose tokens another admitted with it also sent (default: "
                        "those share one prefill, e.g. a GRPO group's answers to one prompt)")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="a streamed /generate sends only what is new in each event (default: the answer so far, "
                        "as SGLang does)")
    p.add_argument("--weight-update-mode", choices=("swap", "drain"), default="swap",
                   help="swap: a weight update goes in between two steps and the requests in flight go on under "
                        "it, their replies saying which tokens each version made (default; what asynchronous RL "
                        "wants); drain: it waits for them to finish and holds new ones, as SGLang's update does")
    p.add_argument("--lanes", type=int, default=None,
                   help="slot groups decoded concurrently (not an SGLang flag; default: 2 on a multi-core CPU "
                        "without tp/dp, else 1)")
    p.add_argument("--wait-for-model", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for --model-path/config.json to appear, importing meanwhile (not an "
                        "SGLang flag: a training run starts its servers while it writes the model they serve)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level of the server's messages")
    return p


def setup_logging(level: str) -> None:
    """Our loggers at ``level``; third-party chatter (jax, absl, ...) stays at warning unless debug."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    if level != "debug":
        for name in ("jax", "absl", "aiohttp.access", "urllib3", "filelock"):
            logging.getLogger(name).setLevel(logging.WARNING)


def make_mesh_for(tp_size: int, dp_size: int) -> Any:
    """A (data=dp, fsdp=1, tensor=tp) mesh over the first tp x dp local devices; None for 1 x 1."""
    if tp_size < 1 or dp_size < 1:
        raise SystemExit(f"areal-jax serve: --tp-size and --dp-size must be >= 1, got {tp_size} and {dp_size}")
    if tp_size * dp_size == 1:
        return None
    import jax

    from sharding import MeshConfig, make_mesh

    devices = jax.local_devices()
    if tp_size * dp_size > len(devices):
        raise SystemExit(f"areal-jax serve: --tp-size {tp_size} x --dp-size {dp_size} needs {tp_size * dp_size} "
                         f"devices, this host has {len(devices)} ({devices[0].platform})")
    return make_mesh(MeshConfig(data=dp_size, fsdp=1, tensor=tp_size), devices[:tp_size * dp_size])


def context_length(requested: int | None, model_max: int, allow_longer: bool) -> int:
    """The context length to serve: the model's ``max_position_embeddings`` unless asked for
    less; more only with ``allow_longer`` (positions past the trained range are extrapolation)."""
    if requested is None:
        return model_max
    if requested < 2:
        raise SystemExit(f"areal-jax serve: --context-length must be >= 2, got {requested}")
    if requested > model_max and not allow_longer:
        raise SystemExit(f"areal-jax serve: --context-length {requested} exceeds the model's max_position_embeddings "
                         f"({model_max}); pass --allow-overwrite-longer-context-len (or set "
                         f"{LONGER_CONTEXT_ENV}=1) to serve it anyway, or lower --context-length")
    return requested


def engine_config(args: argparse.Namespace, context: int, *, data_parallel: bool = False,
                  seed: int | None = None) -> Any:
    """The ``EngineConfig`` of parsed serve flags, for a context length of ``context`` tokens.
    ``data_parallel``: one engine whose mesh has a data axis (its requests split over devices), which
    keeps the slot cache: a page pool is one per engine and does not split over a data axis (the
    server runs paged data parallelism as replicas instead, ``inference.replicas``)."""
    from areal_jax.inference.config import EngineConfig, default_kv_cache
    from areal_jax.inference.paged_shapes import PagedShapes

    kv_cache = args.kv_cache or default_kv_cache()
    if data_parallel and kv_cache == "paged":
        if args.kv_cache == "paged":
            raise SystemExit("--kv-cache paged does not split over one mesh's data axis (a local engine whose mesh "
                             "has a data or fsdp axis > 1); use --kv-cache slots there, or `areal-jax serve "
                             "--dp-size N`, which runs one paged engine per data-parallel rank")
        log.info("KV cache: slots, not the default paged pool: the pool does not split over one mesh's data-parallel "
                 "devices (a local engine's mesh with a data or fsdp axis > 1)")
        kv_cache = "slots"
    return EngineConfig(num_slots=args.max_running_requests, max_seq_len=context,
                        seed=args.random_seed if args.random_seed is not None else seed, lanes=args.lanes,
                        max_queued_requests=args.max_queued_requests, chunked_prefill_size=args.chunked_prefill_size,
                        share_prompts=not args.disable_radix_cache, kv_cache=kv_cache, page_size=args.page_size,
                        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
                        attention_backend=args.attention_backend, layer_layout=args.layer_layout,
                        compile_threads=PagedShapes.default_compile_threads() if args.compile_threads is None
                        else args.compile_threads)


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    """The app and its engine for parsed ``args`` (the engine is not started)."""
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("areal-jax serve: --api-key is empty (an unset variable?); give a key, or leave the flag out "
                         "to serve without one")
    from areal_jax.inference.config import default_kv_cache
    from areal_jax.inference.engine import Engine
    from areal_jax.models import ModelConfig, load_pretrained, load_tokenizer

    if args.wait_for_model > 0:
        wait_for_model(Path(args.model_path), args.wait_for_model)
    imported = process_age()  # interpreter start, imports and any wait: all before the model loads
    t0 = time.perf_counter()

    model_max = ModelConfig.from_json_file(Path(args.model_path) / "config.json").max_position_embeddings
    allow = args.allow_overwrite_longer_context_len or os.environ.get(LONGER_CONTEXT_ENV, "") in ("1", "true", "True")
    max_seq_len = context_length(args.context_length, model_max, allow)
    if args.dp_size > 1 and (args.kv_cache or default_kv_cache()) == "paged":
        engine = build_replicas(args, max_seq_len)
    else:
        mesh = make_mesh_for(args.tp_size, args.dp_size)
        if args.max_running_requests % args.dp_size:
            raise SystemExit(f"areal-jax serve: --max-running-requests {args.max_running_requests} must be a "
                             f"multiple of --dp-size {args.dp_size}")
        cfg = engine_config(args, max_seq_len, data_parallel=args.dp_size > 1)
        # q/k/v and gate/up as one matmul each (models.fused): HF tensors in and out keep their names.
        model = load_pretrained(args.model_path, dtype=args.dtype, mesh=mesh, fuse_projections=True)
        engine = Engine(model, cfg, eos_token_ids=model.config.eos_token_ids, mesh=mesh)
    tokenizer = load_tokenizer(args.tokenizer_path or args.model_path)
    # Where this server's start went, for a launcher's start-up timeline (``/get_server_info``).
    startup = {"imports_seconds": imported, "model_and_engine_seconds": time.perf_counter() - t0}
    app = build_app(engine, tokenizer, args.api_key, model_path=args.model_path, tokenizer_path=args.tokenizer_path,
                    served_model_name=args.served_model_name, weight_version=args.weight_version,
                    info={"tp_size": args.tp_size, "dp_size": args.dp_size, **engine.server_info(),
                          "startup_seconds": startup},
                    incremental_streaming_output=args.incremental_streaming_output,
                    warmup=not args.skip_server_warmup, weight_roots=args.weight_roots,
                    max_request_bytes=args.max_request_bytes, max_body_bytes=args.max_weight_bucket_bytes,
                    weight_transfer_timeout_s=args.weight_transfer_timeout,
                    weight_update_mode=args.weight_update_mode)
    return app, engine


def wait_for_model(path: Path, timeout_s: float) -> None:
    """Import what loading a model needs (the tokenizer's library), then wait until
    ``path/config.json`` exists (its writer renames the whole directory into place, so the rest
    is there with it), at most ``timeout_s`` seconds. (``AutoTokenizer``, which imports torch,
    is left to ``load_tokenizer``: a tokenizer it resolved before loads without it.)"""
    from transformers import TokenizersBackend  # noqa: F401 - imported while the model is written

    deadline = time.monotonic() + timeout_s
    while not (path / "config.json").exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"areal-jax serve: {path}/config.json did not appear within --wait-for-model "
                             f"{timeout_s:g}s")
        time.sleep(0.05)


def build_replicas(args: argparse.Namespace, max_seq_len: int) -> Any:
    """The paged engine over ``--dp-size`` ranks: one replica per rank on ``--tp-size`` devices of
    its own, each with the flags' limits (``inference.replicas.ReplicaEngine``)."""
    import jax

    from areal_jax.inference.replicas import ReplicaEngine
    from areal_jax.models import load_pretrained

    make_mesh_for(args.tp_size, args.dp_size)  # checks the sizes against this host's devices

    def load(mesh: Any) -> Any:  # fused q/k/v and gate/up, as one engine loads them
        return load_pretrained(args.model_path, dtype=args.dtype, mesh=mesh, fuse_projections=True)

    # each replica's eos ids: its model's config (Engine's default)
    return ReplicaEngine.build(load, engine_config(args, max_seq_len), dp_size=args.dp_size, tp_size=args.tp_size,
                               devices=jax.local_devices()[:args.dp_size * args.tp_size])


def parent_pid() -> int | None:
    """The pid of the fleet that started this server (``AREAL_JAX_PARENT_PID``), taken out of the
    environment so that nothing this process starts inherits it; None when not started by one."""
    value = os.environ.pop(PARENT_PID_ENV, None)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a pid", PARENT_PID_ENV, value)
        return None


async def watch_parent(parent: int, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    """Set ``stop`` once ``parent`` is no longer this process's parent. A fleet's servers run in
    their own session, so a trainer killed outright (SIGKILL, the OOM killer) cannot stop them and
    no signal reaches them: without this they would keep their port and device memory forever."""
    while not stop.is_set():
        if os.getppid() != parent:  # re-parented to init or a subreaper
            log.warning("the process that started this server (pid %d) is gone: shutting down", parent)
            stop.set()
            return
        await asyncio.sleep(interval_s)


DEAD_ENGINE_EXIT_CODE = 1


async def serve(args: argparse.Namespace) -> int:
    """Load the model and serve it until SIGTERM, cancellation, the death of the fleet that
    started it, or the death of its engine; returns the exit status (0, or
    ``DEAD_ENGINE_EXIT_CODE`` when the engine died)."""
    parent = parent_pid()
    app, engine = build(args)
    return await serve_app(app, engine, args, parent)


async def serve_app(app: Any, engine: Any, args: argparse.Namespace, parent: int | None = None) -> int:
    """Serve ``app`` over ``engine`` (``build``) as ``serve`` does; returns the exit status."""
    cfg = engine.cfg
    runner, bound = await start_server(app, args.host, args.port)
    if not args.api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who reaches this port can generate and replace "
                    "the weights", args.host)
    # data-parallel replicas (inference.replicas): the limits are each rank's
    slots = (f"{engine.dp_size} replicas of {cfg.num_slots} running requests" if hasattr(engine, "replicas")
             else f"{cfg.num_slots} running requests in {engine.num_lanes} lane(s)")
    log.info("serving %s on http://%s:%d (tp %d, dp %d, %s KV cache, %s, context %d, random seed %d)%s",
             args.model_path, args.host, bound, args.tp_size, args.dp_size, cfg.kv_cache, slots, cfg.max_seq_len,
             engine.seed,
             "" if args.skip_server_warmup else f"; compiling {len(engine.step_shapes())} step shapes first")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        log.info("SIGTERM: shutting down")
        stop.set()

    with contextlib.suppress(NotImplementedError):  # SIGTERM (a launcher stopping us) shuts down cleanly
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    watchdog = asyncio.create_task(watch_parent(parent, stop)) if parent is not None else None
    dead = asyncio.create_task(engine.wait_dead())
    dead.add_done_callback(lambda _: stop.set())
    try:
        await stop.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        if not dead.done():
            dead.cancel()
        await runner.cleanup()  # answers the requests in flight with their partial output first
    if dead.done() and not dead.cancelled():
        log.error("the engine is dead (%r): exiting with status %d so that it is restarted", dead.result(),
                  DEAD_ENGINE_EXIT_CODE)
        return DEAD_ENGINE_EXIT_CODE
    return 0


def run_server(argv: list[str] | argparse.Namespace | None = None) -> None:
    """Entry point for ``areal-jax serve`` (argv list or parsed args)."""
    args = argv if isinstance(argv, argparse.Namespace) else parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        code = asyncio.run(serve(args))
    except KeyboardInterrupt:
        code = 0
    if code:
        sys.exit(code)


if __name__ == "__main__":
    run_server()
