"""The ``areal-jax`` command: ``train`` (an RL run from a YAML config), ``eval`` (held-out
accuracy of a checkpoint), ``serve`` (the embedded SGLang-protocol server), ``demo`` (the
rollout side on its own: generation through the client with a weight update mid-answer) and
``bench`` (the system benchmarks, ``areal_jax.bench``). Every command but ``serve`` turns SIGTERM
into a clean shutdown, as Ctrl-C, so the rollout servers it started are stopped with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

DEMO_QUESTIONS = ["12+7=", "3*4=", "What is 9-5?", "20/4=", "6+6+6=", "Is 7 prime?", "2^5=", "15-8="]


def _demo_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="areal-jax demo", description=(
        "Build a tiny model, serve it on the embedded JAX server, generate through the rollout "
        "client, and push new weights while answers are being generated."))
    p.add_argument("--workdir", default="runs/demo", help="where the checkpoints go")
    p.add_argument("--model-type", default="qwen2", choices=["qwen2", "qwen3", "llama"])
    p.add_argument("--requests", type=int, default=32, help="concurrent answers per round")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


async def _demo(args: argparse.Namespace) -> None:
    import numpy as np

    from areal_jax.inference.engine import Engine, EngineConfig
    from areal_jax.models import encode_chat, iter_hf_tensors, load_pretrained, load_tokenizer
    from areal_jax.models.tiny import make_tiny_checkpoint
    from rollout_bridge.client import HttpRolloutClient
    from rollout_bridge.server import build_app, start_server
    from rollout_bridge.streamer import HttpBucketSink

    work = Path(args.workdir)
    base = work / f"base-{args.model_type}"
    t0 = time.perf_counter()
    if not (base / "config.json").exists():
        make_tiny_checkpoint(base, model_type=args.model_type, seed=args.seed)
        print(f"[1/4] built a tiny random {args.model_type} checkpoint in {base} ({time.perf_counter() - t0:.1f}s)")
    else:
        print(f"[1/4] using the tiny checkpoint in {base}")
    tok = load_tokenizer(base)
    model = load_pretrained(base)
    print(f"      {model.config.num_params():,} parameters, vocab {model.config.vocab_size}")

    engine = Engine(model, EngineConfig(num_slots=min(32, args.requests), max_seq_len=256, seed=args.seed),
                    eos_token_ids=model.config.eos_token_ids)
    runner, port = await start_server(build_app(engine, tok, None, model_path=str(base)), "127.0.0.1", 0)
    address = f"127.0.0.1:{port}"
    print(f"[2/4] embedded JAX server speaking SGLang's protocol on http://{address}")
    try:
        async with HttpRolloutClient([address]) as client:
            prompts = [encode_chat(tok, [{"role": "user", "content": DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]}])
                       for i in range(args.requests)]
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}
            await asyncio.gather(*(client.generate(p, sp) for p in prompts))  # compile outside the timing
            t1 = time.perf_counter()
            results = await asyncio.gather(*(client.generate(p, sp) for p in prompts))
            dt = time.perf_counter() - t1
            n_tok = sum(len(r.output_ids) for r in results)
            print(f"[3/4] {len(results)} concurrent answers, {n_tok} tokens in {dt:.2f}s "
                  f"({n_tok / dt:,.0f} tok/s); the untrained model babbles:")
            for r in results[:2]:
                print(f"      {tok.decode(r.input_ids)!r} -> {tok.decode(r.output_ids)!r}")

            # An interrupted rollout: new weights (version 1) arrive while answers are half done.
            rng = np.random.default_rng(args.seed)
            new = {name: (arr + 0.02 * rng.standard_normal(arr.shape).astype(arr.dtype))
                   for name, arr in iter_hf_tensors(model)}
            start = engine.stats["decode_tokens"]
            tasks = [asyncio.create_task(client.generate(p, sp)) for p in prompts]
            while engine.stats["decode_tokens"] - start < n_tok // 3:  # about a third of the way through
                await asyncio.sleep(0.001)
            await client.pause("abort")
            metrics = await HttpBucketSink(client).push(1, iter(new.items()))
            await client.continue_generation()
            results = await asyncio.gather(*tasks)
            spans = sum(1 for r in results if len(set(r.output_versions)) > 1)
            print(f"[4/4] pushed version 1 mid-generation ({metrics.bytes / 2**20:.1f} MiB in {metrics.buckets} "
                  f"bucket(s), {metrics.seconds:.2f}s); {spans}/{len(results)} answers hold tokens of versions "
                  f"0 and 1, e.g. versions {_runs(results[0].output_versions)}")
    finally:
        await runner.cleanup()
        await engine.stop()
    print(f"done in {time.perf_counter() - t0:.1f}s")


def _runs(versions: list[int]) -> str:
    out: list[str] = []
    for v in versions:
        if out and out[-1].startswith(f"{v}x"):
            n = int(out[-1].split("x")[1]) + 1
            out[-1] = f"{v}x{n}"
        else:
            out.append(f"{v}x1")
    return " ".join(out)


COMMANDS = {
    "train": "run RL from a YAML config: areal-jax train --config FILE [--resume] [key=value ...]",
    "eval": "held-out accuracy of a checkpoint: areal-jax eval --config FILE --model-path DIR",
    "serve": "run the embedded JAX inference server (SGLang's HTTP protocol)",
    "demo": "the rollout side alone: a tiny model served, answers generated, weights pushed mid-answer",
    "bench": "system benchmarks: areal-jax bench [--parts async,staleness,interrupt,components] [--quick] [--out DIR]",
}


def _train_args(argv: list[str], prog: str, with_model: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=COMMANDS[prog.split()[-1]],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", required=True, action="append",
                   help="YAML run config (see configs/); given again, the files merge in order, later keys winning")
    if with_model:
        p.add_argument("--model-path", required=True, help="HF model directory to evaluate")
    else:
        p.add_argument("--resume", action="store_true",
                       help="continue from the newest complete checkpoint in checkpoint.dir (afresh if none)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="what the run logs besides its progress lines")
    p.add_argument("--print-config", action="store_true",
                   help="check the config (every value, and that the reward and workflow import), print it "
                        "resolved as YAML and exit")
    p.add_argument("--help-config", metavar="SECTION", nargs="?", const="",
                   help="list every config key (or those under SECTION, e.g. rollout) with its type, default "
                        "and meaning, and exit")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=20 rollout.max_staleness=4")
    _help_config(argv)
    args = p.parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    return args


def _help_config(argv: list[str]) -> None:
    """``--help-config [SECTION]`` needs no ``--config``: answer it before argparse asks for one."""
    if "--help-config" not in argv:
        return
    from areal_jax.config import ConfigError, config_help
    from areal_jax.trainer.run_config import RunConfig

    i = argv.index("--help-config")
    section = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else ""
    try:
        text = config_help(RunConfig, section)
    except ConfigError as e:
        sys.exit(f"areal-jax: {e}")
    print("Config keys (YAML nests them; on the command line: key=value, e.g. steps=20):\n")
    print(text, end="")
    sys.exit(0)


def _load_checked(args: argparse.Namespace, prog: str) -> object:
    """The run config, every value checked and the modules it names imported, or exit with the
    message. The config file's folder and the working directory go on the import path first."""
    from areal_jax.config import ConfigError, add_config_folders_to_path

    # Only the config modules: this path (``--print-config`` among others) must not pay for the
    # trainer, the engine and the HTTP stack.
    from areal_jax.trainer.run_config import check_imports, load_run_config

    add_config_folders_to_path(args.config)
    try:
        cfg = load_run_config(args.config, args.overrides)
        check_imports(cfg)
    except (ConfigError, ValueError) as e:
        sys.exit(f"{prog}: {e}")
    if getattr(args, "print_config", False):
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        sys.exit(0)
    return cfg


def _train(argv: list[str]) -> None:
    from areal_jax.config import ConfigError
    from areal_jax.data import DatasetError

    args = _train_args(argv, "areal-jax train")
    cfg = _load_checked(args, "areal-jax train")
    from areal_jax.trainer.rl import run_summary, train
    print(f"run directory: {cfg.run_dir} (metrics.jsonl, tensorboard/, curves.png, checkpoints/, final/); "
          f"watch with: tensorboard --logdir {cfg.run_dir}", flush=True)
    from areal_jax.rewards.isolation import SandboxUnavailable
    from areal_jax.trainer.checkpoint import CheckpointError

    try:
        result = train(cfg, resume=args.resume)
    except (ConfigError, DatasetError, CheckpointError, SandboxUnavailable) as e:  # found before any work started
        sys.exit(f"areal-jax train: {e}")
    print(run_summary(result))


def _eval(argv: list[str]) -> None:
    from areal_jax.config import ConfigError
    from areal_jax.data import DatasetError
    from areal_jax.trainer.evaluate import evaluate_checkpoint

    args = _train_args(argv, "areal-jax eval", with_model=True)
    cfg = _load_checked(args, "areal-jax eval")
    from areal_jax.rewards.isolation import SandboxUnavailable

    try:
        out = evaluate_checkpoint(cfg, args.model_path)
    except (ConfigError, DatasetError, FileNotFoundError, SandboxUnavailable) as e:  # a wrong --model-path, data...
        sys.exit(f"areal-jax eval: {e}")
    print(f"{args.model_path}: held-out accuracy {out['eval_accuracy']:.1%}, mean reward {out['eval_reward']:.3f} "
          f"on {out['eval_prompts']} prompts")


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Within this block, SIGTERM (``kill``, ``timeout``, a scheduler ending the job) ends the
    process as Ctrl-C does: ``SystemExit`` raised in the main thread runs the ``finally`` blocks
    and context managers on its way out, which stop the rollout servers this process started
    (they run in a session of their own, so the signal does not reach them) and let a checkpoint
    being written finish. The default action ends the process on the spot and leaves them
    running. A second SIGTERM takes the default action, for a clean-up that hangs (a thread stuck
    in a collective, say); embedded servers then stop by themselves. Outside the main thread
    (signal handlers live there) this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print("areal-jax: SIGTERM: shutting down (stopping the rollout servers; SIGTERM again to end at once)",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: areal-jax {" + ",".join(COMMANDS) + "} ...\n\ncommands:\n"
              + "\n".join(f"  {k:<6} {v}" for k, v in COMMANDS.items())
              + "\n\n'areal-jax COMMAND --help' describes each.")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    cmd, rest = argv[0], argv[1:]
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # tokenizers only: no "PyTorch was not found" notice
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if cmd == "serve":  # it answers SIGTERM itself, in its event loop
        from rollout_bridge.serve import run_server

        run_server(rest)
        return
    with stop_on_sigterm():  # every other command may start servers
        if cmd == "demo":
            asyncio.run(_demo(_demo_args(rest)))
        elif cmd == "train":
            _train(rest)
        elif cmd == "eval":
            _eval(rest)
        elif cmd == "bench":
            from areal_jax.bench.cli import main as bench_main

            bench_main(rest)


if __name__ == "__main__":
    main()
