"""Issue 15, server side: loopback by default, the API key on every endpoint but the health
checks, weight loads only from under the weight roots, bounded bodies, stale transfers dropped."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from areal_jax.models import load_pretrained, load_tokenizer
from areal_jax.models.safetensors_codec import encode_tensor_bucket
from rollout_bridge.launcher import ServerFleet
from rollout_bridge.serve import parser
from rollout_bridge.server import OPEN_PATHS, build_app, start_server
from rollout_bridge.state import STATE

TIMEOUT = aiohttp.ClientTimeout(total=60)


@asynccontextmanager
async def _server(model_dir: Path, **app_kw: Any) -> AsyncIterator[tuple[str, Any]]:
    """A server over ``model_dir``; yields (base URL, app)."""
    from areal_jax.inference.engine import Engine, EngineConfig

    model = load_pretrained(model_dir)
    engine = Engine(model, EngineConfig(num_slots=4, max_seq_len=64), eos_token_ids=model.config.eos_token_ids)
    app = build_app(engine, load_tokenizer(model_dir), model_path=str(model_dir), **app_kw)
    runner, port = await start_server(app)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


def test_loopback_is_the_default_address() -> None:
    assert parser().parse_args(["--model-path", "m"]).host == "127.0.0.1"


def test_every_endpoint_but_health_wants_the_key(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rollout_bridge.server as server

    compared: list[tuple[bytes, bytes]] = []
    real = server.hmac.compare_digest
    monkeypatch.setattr(server.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))

    async def main() -> None:
        async with _server(tiny_dir, api_key="k3y") as (url, app), aiohttp.ClientSession(timeout=TIMEOUT) as s:
            assert app[STATE].host == "127.0.0.1"  # start_server's default address
            routes = sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})
            assert len(routes) > 20  # native, weights and /v1 endpoints all registered
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
                    async with s.request(method, url + path, json={}, headers=headers) as r:
                        if path in OPEN_PATHS:
                            assert r.status == 200, (method, path, r.status)
                        else:
                            assert r.status == 401, (method, path, headers, r.status)
                            assert "API key" in (await r.json())["error"]["message"]
            async with s.get(url + "/get_model_info", headers={"Authorization": "Bearer k3y"}) as r:
                assert r.status == 200
        assert (b"Bearer k3y", b"Bearer k3y") in compared  # the key is checked in constant time

    asyncio.run(main())


# --- weight roots ----------------------------------------------------------------------------------

def test_disk_loads_only_from_under_the_weight_roots(tiny_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_dir, run / "base")
    shutil.copytree(tiny_dir, run / "weights" / "v1")
    shutil.copytree(tiny_dir, tmp_path / "outside" / "model")
    (run / "link").symlink_to(tmp_path / "outside" / "model")
    (run / "weights" / "escape").symlink_to(tmp_path / "outside")

    async def main() -> None:
        async with _server(run / "base") as (url, app), aiohttp.ClientSession(timeout=TIMEOUT) as s:
            assert app[STATE].weight_roots == (str(run.resolve()),)  # default: the served model's parent

            async def push(path: str) -> tuple[int, dict]:
                async with s.post(url + "/update_weights_from_disk", json={"model_path": path}) as r:
                    return r.status, await r.json()

            status, body = await push(str(run / "weights" / "v1"))
            assert status == 200 and body["success"], body  # a run's own pushes load
            status, body = await push(str(run / "weights" / ".." / "weights" / "v1"))
            assert status == 200 and body["success"], body
            version = app[STATE].engine.version
            refused = [str(tmp_path / "outside" / "model"), str(run / "link"),
                       str(run / "weights" / "escape" / "model"), str(run / ".." / "outside" / "model"),
                       str(run / "weights" / "v9"), str(tmp_path / "outside" / "nowhere"), "/etc", "relative/dir",
                       "file:///etc", "gs://bucket/x"]
            messages = set()
            for path in refused:
                status, body = await push(path)
                assert status == 400 and not body["success"], (path, body)
                messages.add(body["message"].replace(repr(path), "PATH"))
            # missing or forbidden, inside or outside: one answer, naming only what was sent
            assert len(messages) == 1, messages
            assert "weight roots" in messages.pop()
            assert app[STATE].engine.version == version  # nothing was loaded

    asyncio.run(main())


def test_weight_roots_flag_and_the_fleet_default(tmp_path: Path) -> None:
    args = parser().parse_args(["--model-path", "m", "--weight-roots", "/a", "/b", "--weight-roots", "/c"])
    assert args.weight_roots == ["/a", "/b", "/c"]
    assert parser().parse_args(["--model-path", "m"]).weight_roots is None
    # the fleet a run starts: its servers load from the model's directory and from the run directory
    fleet = ServerFleet(tmp_path / "ext" / "model", 1, tmp_path / "run" / "logs")
    assert fleet.weight_roots == [str(tmp_path / "ext"), str(tmp_path / "run")]


# --- bounded bodies and stale transfers ---------------------------------------------------------------

def test_bodies_past_their_bound_are_a_413(tiny_dir: Path) -> None:
    async def main() -> None:
        async with _server(tiny_dir, max_request_bytes=4096, max_body_bytes=1 << 20) as (url, _), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            small = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            async with s.post(url + "/generate", json=small) as r:
                assert r.status == 200
            big = {"input_ids": [1, 2], "padding": "x" * 5000}
            for path in ("/generate", "/v1/completions", "/abort_request", "/update_weights_from_disk"):
                async with s.post(url + path, json=big) as r:
                    assert r.status == 413, (path, r.status)
                    assert "too large" in (await r.json())["error"]["message"]

            async def chunked() -> AsyncIterator[bytes]:  # no Content-Length
                yield b'{"input_ids": [1, 2], "padding": "'
                for _ in range(10):
                    yield b"y" * 1000
                yield b'"}'

            async with s.post(url + "/generate", data=chunked()) as r:
                assert r.status == 413
            q = {"weight_version": "v", "transfer_id": "t", "bucket": "0", "last": "true"}
            bucket = encode_tensor_bucket({"w": np.zeros(300_000, np.float32)})  # 1.2 MB
            async with s.post(url + "/update_weights_from_tensor", params=q, data=bucket,
                              headers={"Content-Type": "application/octet-stream"}) as r:
                assert r.status == 413
            async with s.get(url + "/health_generate") as r:  # the engine still generates
                assert r.status == 200

    asyncio.run(main())


def test_an_unfinished_weight_transfer_is_dropped_after_the_timeout(tiny_dir: Path) -> None:
    async def main() -> None:
        async with _server(tiny_dir, weight_transfer_timeout_s=2.0) as (url, app), \
                aiohttp.ClientSession(timeout=TIMEOUT) as s:
            st = app[STATE]
            model = load_pretrained(tiny_dir)
            from areal_jax.models import iter_hf_tensors

            name, arr = next(iter(iter_hf_tensors(model)))
            hdr = {"Content-Type": "application/octet-stream"}

            async def bucket(i: int, tensors: dict, last: bool = False) -> int:
                q = {"weight_version": "v2", "transfer_id": "t1", "bucket": str(i), "last": str(last).lower()}
                async with s.post(url + "/update_weights_from_tensor", params=q, headers=hdr,
                                  data=encode_tensor_bucket(tensors)) as r:
                    return r.status

            (name2, arr2) = list(iter_hf_tensors(model))[1]
            assert await bucket(0, {name: np.asarray(arr)}) == 200
            assert st.staged is not None
            await st.staged.work  # converted in the background
            assert name in st.staged.stage.received
            timer = st.staged.timer
            assert await bucket(1, {name2: np.asarray(arr2)}) == 200
            assert timer.cancelled() and st.staged.timer is not timer  # a bucket re-arms the drop
            while st.staged is not None:  # then nothing more comes: dropped, tensors and all
                await asyncio.sleep(0.05)
            assert await bucket(2, {"other": np.zeros(2, np.float32)}, last=True) == 400
            assert st.engine.version == 0 and st.weight_version == "default"

    asyncio.run(main())


def test_url_weight_roots_take_paths_under_them_only() -> None:
    from rollout_bridge.server import resolve_weight_roots
    from rollout_bridge.state import ServerState
    from rollout_bridge.weights_api import resolve_model_dir

    st = ServerState(engine=None, tokenizer=None, api_key=None,
                     weight_roots=resolve_weight_roots(["gs://bucket/run/", "/nonexistent-root"]))
    assert st.weight_roots == ("gs://bucket/run", "/nonexistent-root")
    assert resolve_model_dir(st, "gs://bucket/run/weights/v00000001") == "gs://bucket/run/weights/v00000001"
    for path in ("gs://bucket/run", "gs://bucket/running/v1", "gs://bucket/run/../other", "gs://other/run/v1",
                 "s3://bucket/run/v1", "/nonexistent-root/../etc", "", 5, None, "/nonexistent-root/x\x00"):
        assert resolve_model_dir(st, path) is None, path


def test_an_empty_api_key_is_refused_not_ignored(tmp_path: Path) -> None:
    """``--api-key "$KEY"`` with KEY unset would otherwise serve every endpoint without a key."""
    from rollout_bridge.serve import build

    for key in ("", "  "):
        with pytest.raises(SystemExit, match="--api-key is empty"):
            build(parser().parse_args(["--model-path", str(tmp_path / "m"), "--api-key", key]))


def test_an_endless_chunked_body_is_cut_at_the_bound(tiny_dir: Path) -> None:
    """A chunked body has no Content-Length: the server stops reading at the endpoint's bound
    (here 4 KiB for /generate) and answers 413, rather than holding up to the bucket bound."""
    import select
    import socket

    def flood(port: int) -> tuple[int, bytes]:
        """Send chunks until the server answers; (bytes sent by then, the answer)."""
        sent, reply = 0, b""
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"10000\r\n" + b"a" * 0x10000 + b"\r\n"
            while sent < 256 << 20 and not reply:
                try:
                    s.sendall(chunk)
                    sent += len(chunk)
                except OSError:
                    break
                if select.select([s], [], [], 0)[0]:
                    reply = s.recv(4096)
            if not reply:
                reply = s.recv(4096)
        return sent, reply

    async def main() -> None:
        async with _server(tiny_dir, max_request_bytes=4096, max_body_bytes=512 << 20) as (url, _):
            port = int(url.rsplit(":", 1)[1])
            sent, reply = await asyncio.to_thread(flood, port)
            assert sent < 64 << 20, sent  # answered long before the 512 MiB bucket bound
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url + "/health_generate") as r:
                assert r.status == 200  # the engine still generates

    asyncio.run(main())
