"""``areal-jax serve`` as a user runs it: --help shows the defaults; the flags reach the engine and
the log level; a server sharded over 8 fake devices (--tp-size 2 --dp-size 2) says where it
listens and answers as one device does."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from areal_jax.models import load_pretrained
from tests import xla_flags
from tests.inference.reference import reference_greedy
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_serve_help_shows_defaults() -> None:
    from rollout_bridge.serve import parser

    text = parser().format_help().split("options:", 1)[1]
    for flag, default in (("--chunked-prefill-size", "1024"), ("--max-running-requests", "32"),
                          ("--context-length", "the model's max_position_embeddings"),
                          ("--weight-version", "default"), ("--tp-size", "1"), ("--log-level", "info"),
                          ("--max-queued-requests", "unbounded"), ("--random-seed", "drawn at random at start")):
        assert flag in text, flag
        block = " ".join(text.split(flag, 1)[1].split("\n  --", 1)[0].split())
        assert f"(default: {default})" in block and block.count("(default") == 1, (flag, block)
    assert "(default: None)" not in text


def test_queue_bound_and_random_seed_reach_the_engine(tiny_dir: Path) -> None:
    """--max-queued-requests bounds the engine's queue; without --random-seed each server draws its
    own seed (two servers started alike do not sample alike), with it the seed is the one given."""
    from rollout_bridge.serve import build, parser

    base = ["--model-path", str(tiny_dir), "--max-running-requests", "2", "--lanes", "1", "--context-length", "64"]
    engines = [build(parser().parse_args(base))[1] for _ in range(2)]
    assert [e.cfg.max_queued_requests for e in engines] == [None, None]
    assert [e.cfg.seed for e in engines] == [None, None] and engines[0].seed != engines[1].seed
    app, engine = build(parser().parse_args([*base, "--max-queued-requests", "3", "--random-seed", "7"]))
    assert (engine.cfg.max_queued_requests, engine.seed) == (3, 7)


def test_attention_backend_reaches_the_engine_and_an_impossible_choice_fails_at_start(tiny_dir: Path) -> None:
    """--attention-backend (sglang-jax's values): auto runs the XLA path on a CPU and says so in
    /get_server_info's fields; fa, which has no kernel on a CPU (nor any over the slot cache),
    fails at start naming the flag."""
    from rollout_bridge.serve import build, parser

    base = ["--model-path", str(tiny_dir), "--max-running-requests", "2", "--context-length", "64"]
    engine = build(parser().parse_args(base))[1]
    assert (engine.cfg.attention_backend, engine.server_info()["attention_backend"]) == ("auto", "native")
    with pytest.raises(ValueError, match="--attention-backend fa: no paged attention kernel runs on 'cpu'; "
                                         "use --attention-backend native"):
        build(parser().parse_args([*base, "--attention-backend", "fa"]))
    with pytest.raises(ValueError, match="runs over the page pool, not kv_cache='slots'"):
        build(parser().parse_args([*base, "--attention-backend", "fa", "--kv-cache", "slots"]))


def test_log_level_sets_what_the_server_logs(capsys: pytest.CaptureFixture[str]) -> None:
    """The level run_server sets up: warning drops the "serving ... on" line, debug adds our debug
    lines (a client that went away); jax's info chatter stays out at info."""
    from rollout_bridge.serve import setup_logging

    root = logging.getLogger()
    quiet = ("jax", "absl", "aiohttp.access", "urllib3", "filelock")
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level for n in quiet}
    root.handlers.clear()  # pytest's own handlers: kept out of basicConfig(force=True), put back below

    def logged(level: str) -> str:
        setup_logging(level)
        logging.getLogger("rollout_bridge.serve").info("serving m on http://127.0.0.1:1")
        logging.getLogger("rollout_bridge.server").debug("POST /generate: client closed the connection")
        logging.getLogger("rollout_bridge.serve").warning("listening on 0.0.0.0 without --api-key")
        logging.getLogger("jax").info("jax chatter")
        return capsys.readouterr().err

    try:
        warning, info, debug = logged("warning"), logged("info"), logged("debug")
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for n, lv in levels.items():
            logging.getLogger(n).setLevel(lv)
    assert "without --api-key" in warning and "serving" not in warning and "client closed" not in warning
    assert "serving m on" in info and "client closed" not in info and "jax chatter" not in info
    assert "serving m on" in debug and "DEBUG rollout_bridge.server: POST /generate" in debug


def test_context_length_defaults_to_the_model_and_exceeds_it_only_when_allowed(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_bridge.serve import LONGER_CONTEXT_ENV, build, parser

    monkeypatch.delenv(LONGER_CONTEXT_ENV, raising=False)
    model_max = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    base = ["--model-path", str(tiny_dir), "--max-running-requests", "2", "--lanes", "1"]
    served = lambda *extra: build(parser().parse_args([*base, *extra]))[1].max_seq_len  # noqa: E731
    assert served() == model_max
    assert served("--context-length", "64") == 64
    with pytest.raises(SystemExit, match="--allow-overwrite-longer-context-len"):
        served("--context-length", str(2 * model_max))
    assert served("--context-length", str(2 * model_max), "--allow-overwrite-longer-context-len") == 2 * model_max
    monkeypatch.setenv(LONGER_CONTEXT_ENV, "1")
    assert served("--context-length", str(2 * model_max)) == 2 * model_max


def test_a_bfloat16_checkpoint_is_served_in_bfloat16_and_float16_on_request(tmp_path: Path) -> None:
    """``serve`` keeps a bfloat16 checkpoint's dtype in the engine's parameters and KV cache (no
    float32 copy at twice the memory); ``--dtype float16`` serves it in float16, with logprobs
    a float16 full forward pass agrees with."""
    import jax
    import jax.numpy as jnp

    from areal_jax.inference import GenerateRequest, SamplingParams
    from areal_jax.models.tiny import make_tiny_checkpoint
    from rollout_bridge.serve import build, parser
    from tests.inference.reference import generate_all, reference_logprobs

    ckpt = make_tiny_checkpoint(tmp_path / "bf16", param_dtype="bfloat16", dtype="bfloat16")
    assert json.loads((ckpt / "config.json").read_text())["torch_dtype"] == "bfloat16"
    base = ["--model-path", str(ckpt), "--max-running-requests", "2", "--lanes", "1", "--context-length", "64",
            "--skip-server-warmup"]
    for flags, dtype in (([], jnp.bfloat16), (["--dtype", "float16"], jnp.float16)):
        engine = build(parser().parse_args([*base, *flags]))[1]
        assert {x.dtype for x in jax.tree.leaves(engine.state)} == {jnp.dtype(dtype)}, flags
        assert {x.dtype for x in jax.tree.leaves(engine._lanes[0].cache)} == {jnp.dtype(dtype)}, flags
    prompt = [5, 17, 3, 42]
    out = generate_all(engine, [GenerateRequest(prompt, SamplingParams(max_new_tokens=6, temperature=0,
                                                                       ignore_eos=True))])[0]
    want = reference_logprobs(load_pretrained(ckpt, dtype="float16"), prompt, out.output_ids, 0)
    np.testing.assert_allclose(out.output_logprobs, want, atol=1e-2)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_serve_shards_over_devices_and_logs_where_it_listens(tiny_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": xla_flags.devices(8)}
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", str(tiny_dir), "--port", str(port),
             "--tp-size", "2", "--dp-size", "2", "--max-running-requests", "4", "--context-length", "64",
             "--kv-cache", "slots",  # one engine over a data axis (paged dp: test_serve_dp_paged.py)
             "--log-level", "info", "--skip-server-warmup"], env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if f"on {url}" in log.read_text():
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        else:
            raise AssertionError(f"no 'serving ... on {url}' line:\n{log.read_text()[-3000:]}")
        with urllib.request.urlopen(url + "/get_server_info", timeout=30) as r:
            state = json.loads(r.read())["internal_states"][0]
        assert state["tp_size"] == 2 and state["dp_size"] == 2 and state["lanes"] == 1
        # what the engine's arrays say, not the flags echoed: weights split over the tensor axis,
        # the KV cache's slots over the data axis and its kv heads over the tensor axis
        hf = json.loads((tiny_dir / "config.json").read_text())
        placement = state["placement"]
        assert placement["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}
        # The server holds gate/up fused (models.fused), split so each shard has its own columns of both.
        up = placement["params"]["layers.mlp.gate_up_proj.kernel"]
        assert up == {"spec": [None, "fsdp", "tensor"], "shard_shape": [hf["num_hidden_layers"], hf["hidden_size"],
                                                                         2 * hf["intermediate_size"] // 2]}
        assert placement["params"]["layers.self_attn.o_proj.kernel"]["spec"] == [None, "tensor", "fsdp"]
        for name, kv in placement["kv_cache"].items():  # [layers, slots, kv heads, ...]
            assert kv["spec"][:3] == [None, ["data", "fsdp"], "tensor"], name
            assert kv["shard_shape"][:3] == [hf["num_hidden_layers"], 4 // 2, hf["num_key_value_heads"] // 2], name
        prompt = [5, 17, 3, 42]
        reply = _post(url + "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8,
                                                                                   "temperature": 0}})
        model = load_pretrained(tiny_dir)
        assert reply["output_ids"] == reference_greedy(model, prompt, 8, model.config.eos_token_ids)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "ERROR" not in log.read_text()


@pytest.mark.slow
def test_sigterm_answers_requests_in_flight_before_exiting(tiny_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags.FAST_COMPILE}
    log = tmp_path / "serve.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", str(tiny_dir), "--port", str(port),
             "--max-running-requests", "2", "--context-length", "4096", "--log-level", "info",
             "--skip-server-warmup"],
            env=env, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if f"on {url}" in log.read_text():
                break
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        # long enough to be in flight at the signal: the paged engine decodes the tiny model's first
        # 1,000 tokens in about a second on an idle machine
        body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_post, url + "/generate", body)
            for _ in range(3000):  # until the answer has tokens (the server's own counter), not a wall-clock window
                with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                    made = [float(line.split()[-1]) for line in r.read().decode().splitlines()
                            if line.startswith("sglang:generation_tokens_total")]
                if made and made[0] > 0:
                    break
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            reply = pending.result(timeout=60)
        assert reply["meta_info"]["finish_reason"] == {"type": "abort", "message": "server shutting down"}
        assert 0 < len(reply["output_ids"]) < 4000
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait(timeout=30)
