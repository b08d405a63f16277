"""A rollout server process dies mid-generation (SIGKILL): the client re-sends its requests to the
surviving server, continuing from the tokens already received, and nothing is lost. A server that
stops answering (the client's timeout) is told to abort the request before it is re-sent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from areal_jax.models import load_pretrained
from rollout_bridge.client import ClientConfig, HttpRolloutClient
from rollout_bridge.launcher import LaunchError, ServerFleet
from tests import xla_flags
from tests.inference.reference import reference_logprobs
from tests.ports import free_port
from tests.rollout_bridge.bridge_helpers import running_server

ROOT = Path(__file__).resolve().parents[2]


async def _wait_healthy(address: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server process exited with {proc.returncode}")
            try:
                async with session.get(f"http://{address}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"server at {address} not healthy after {timeout}s")


@pytest.mark.slow
def test_killed_server_process_requests_move_to_survivor(tiny_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags.FAST_COMPILE, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", str(tiny_dir), "--port", str(port),
         "--max-running-requests", "8", "--context-length", "512", "--lanes", "2", "--log-level", "warning",
         "--skip-server-warmup", "--kv-cache", "slots"],  # lanes are the slot engine's (the pool runs one loop)
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    model = load_pretrained(tiny_dir)

    async def main() -> None:
        async with running_server(tiny_dir, num_slots=8, max_seq_len=512) as (survivor, _):
            doomed = f"127.0.0.1:{port}"
            await _wait_healthy(doomed, proc)
            async with aiohttp.ClientSession() as s, s.get(f"http://{doomed}/get_server_info") as r:
                assert (await r.json())["internal_states"][0]["lanes"] == 2  # --lanes reached the engine
            cfg = ClientConfig(generate_timeout_s=300, control_timeout_s=30, all_down_wait_s=10, health_interval_s=0.5)
            async with HttpRolloutClient([survivor, doomed], config=cfg) as client:
                sp = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 1.0}
                tasks = [asyncio.create_task(client.generate([3, 4, 5 + i], sp)) for i in range(8)]
                while not client.servers[1].inflight:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.5)  # let the doomed server produce some tokens
                proc.send_signal(signal.SIGKILL)
                results = await asyncio.gather(*tasks)
                assert len({r.rid for r in results}) == 8
                assert all(len(r.output_ids) == 300 for r in results)
                moved = [r for r in results if r.resends > 0]
                assert moved, "no request was re-sent after the server died"
                assert (await client.check_health()) == [True, False]
                later = await asyncio.gather(*(client.generate([9, 9, i], {"max_new_tokens": 5, "ignore_eos": True})
                                             for i in range(4)))
                assert all(len(r.output_ids) == 5 and r.resends == 0 for r in later)  # routed to the survivor
                # A moved answer is one sequence: its logprobs are those of the full forward pass
                # over prompt + all tokens, including the ones produced by the dead server.
                r = moved[0]
                ref = reference_logprobs(model, r.input_ids, r.output_ids, 1.0)
                assert abs(ref - r.output_logprobs).max() < 1e-4

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(timeout=30)


async def _finished(address: str) -> int:
    """Requests the server at ``address`` has finished (its ``/metrics`` counter)."""
    async with aiohttp.ClientSession() as s, s.get(f"http://{address}/metrics") as r:
        text = await r.text()
    return int(float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("sglang:num_requests_total{"))))


@pytest.mark.slow
def test_killed_server_is_restarted_and_taken_back_and_every_rid_answered_once(tiny_dir: Path,
                                                                               tmp_path: Path) -> None:
    """SIGKILL one of two servers mid-generation: every rid gets exactly one answer of full length,
    each finished exactly once on the survivor; the fleet starts the dead one again on its port and
    the client, after reloading it with the version pushed while it was down, sends to it again."""
    fleet = ServerFleet(tiny_dir, 1, tmp_path / "logs", max_restarts=1, startup_timeout_s=180,
                        extra_args=["--max-running-requests", "8", "--context-length", "512", "--log-level",
                                    "warning"], env={"XLA_FLAGS": xla_flags.FAST_COMPILE, "JAX_PLATFORMS": "cpu"})
    fleet.start()

    async def main() -> None:
        async with running_server(tiny_dir, num_slots=16, max_seq_len=512) as (survivor, engine):
            doomed = fleet.addresses[0]
            cfg = ClientConfig(generate_timeout_s=120, control_timeout_s=30, all_down_wait_s=10, health_interval_s=0.5)
            async with HttpRolloutClient([survivor, doomed], config=cfg) as client:
                sp = {"max_new_tokens": 120, "ignore_eos": True, "temperature": 1.0}
                rids = [f"req-{i}" for i in range(16)]
                before = engine.stats["finished_requests"]
                tasks = [asyncio.create_task(client.generate([3, 4, 5 + i], sp, rid=rid)) for i, rid in enumerate(rids)]
                while not client.servers[1].inflight:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.3)
                on_doomed = set(client.servers[1].inflight)
                t_kill = time.monotonic()
                os.kill(fleet.children[0].proc.pid, signal.SIGKILL)
                while client.servers[1].healthy:  # noticed by the requests in flight, well within the timeout
                    assert time.monotonic() - t_kill < cfg.generate_timeout_s
                    await asyncio.sleep(0.01)
                noticed = time.monotonic() - t_kill
                results = await asyncio.wait_for(asyncio.gather(*tasks), cfg.generate_timeout_s)
                took = time.monotonic() - t_kill
                # request-id accounting: each rid submitted has one final answer, none lost, none twice
                assert sorted(r.rid for r in results) == sorted(rids)
                assert all(len(r.output_ids) == 120 and r.finish_reason["type"] == "length" for r in results)
                moved = {r.rid for r in results if r.resends > 0}
                assert moved and moved == {sub.split("-r")[0] for sub in on_doomed}
                # the survivor finished each of them exactly once (the doomed one finished none)
                assert engine.stats["finished_requests"] - before == len(rids)
                print(f"\nkilled a server with {len(on_doomed)} requests in flight: noticed after {noticed:.2f}s, "
                      f"all {len(rids)} answered {took:.1f}s after the kill, {len(moved)} re-sent")

                # the run goes on: a version pushed while the dead server is away, then its restart
                await client.update_weights_from_disk(str(tiny_dir), version=1)
                assert client.in_rotation() == [f"http://{survivor}"]
                await asyncio.to_thread(fleet.children[0].proc.wait, 10)
                fleet.check()  # starts it again on its port instead of raising
                assert fleet.restarts == 1
                await _wait_healthy(doomed, fleet.children[0].proc)
                deadline = time.monotonic() + 30
                while len(client.in_rotation()) < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert client.in_rotation() == [f"http://{survivor}", f"http://{doomed}"]
                assert client.server_versions()[f"http://{doomed}"] == 1  # reloaded before it came back
                later = await asyncio.gather(*(client.generate([9, 9, i], {"max_new_tokens": 4, "ignore_eos": True})
                                               for i in range(8)))
                assert all(len(r.output_ids) == 4 and r.output_versions == [1] * 4 for r in later)
                assert await _finished(doomed) > 0  # the restarted server answers requests again

    try:
        asyncio.run(main())
        fleet.children[0].proc.kill()
        fleet.children[0].proc.wait(10)
        with pytest.raises(LaunchError, match=r"rollout server 0 .* exited with code -9 \(after 1 restarts\)"):
            fleet.check()
    finally:
        fleet.stop()


def test_client_timeout_aborts_on_that_server_before_resending() -> None:
    """Two stand-in servers log what reaches them, in one order. The first never answers /generate
    and, unlike ours, does not stop when the client hangs up: only the client's /abort_request
    frees it. That abort must reach it before the re-send reaches the second server."""
    events: list[tuple[str, str, str]] = []
    release = asyncio.Event()

    def stand_in(name: str, answers: bool) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            events.append((name, "generate", body["rid"]))
            if not answers:
                await release.wait()  # hung: the client's timeout fires, the disconnect changes nothing
            n = body["sampling_params"]["max_new_tokens"]
            return web.json_response({"text": "", "output_ids": [7] * n, "meta_info": {
                "id": body["rid"], "finish_reason": {"type": "length", "length": n},
                "output_token_logprobs": [[-0.5, 7, None]] * n}})

        async def abort(request: web.Request) -> web.Response:
            events.append((name, "abort", (await request.json())["rid"]))
            return web.json_response({})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"weight_version": "default"})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_post("/abort_request", abort)
        app.router.add_get("/health", ok)
        app.router.add_get("/get_model_info", ok)
        return app

    async def main() -> None:
        runners, addrs = [], []
        for name, answers in (("hung", False), ("other", True)):
            runner = web.AppRunner(stand_in(name, answers), handler_cancellation=False)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            addrs.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # noqa: SLF001
        try:
            # Long enough that the answering stand-in is never timed out too, on a loaded machine
            # (it answers at once); the hung one is waited on for this long.
            cfg = ClientConfig(generate_timeout_s=5.0, control_timeout_s=10, health_interval_s=3600)
            async with HttpRolloutClient(addrs, config=cfg) as client:
                result = await client.generate([1, 2], {"max_new_tokens": 3}, rid="r")
            assert result.output_ids == [7] * 3 and result.resends == 1
            assert events == [("hung", "generate", "r"), ("hung", "abort", "r"), ("other", "generate", "r-r1")]
        finally:
            release.set()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(main())
