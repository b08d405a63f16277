"""Soak: an embedded server process under 256 concurrent requests for ``SOAK_SECONDS`` (default
30, after 10 s of warm-up under the same load), with a weight update (pause with abort, load from
disk, continue) every 10 s and a few requests aborted by rid. Every request completes or comes
back aborted, the server's RSS stays flat after warm-up, every KV slot is free at the end, and
/health answers throughout.

``SOAK_SECONDS=120 pytest -s tests/rollout_bridge/test_soak.py`` prints the figures."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests import xla_flags
from tests.ports import free_port
from tests.procmem import resident_mib
from tests.rollout_bridge.test_failover import _wait_healthy

ROOT = Path(__file__).resolve().parents[2]
CONCURRENCY = 256
PUSH_EVERY_S = 10.0
WARMUP_S = 10.0
"""The same load before the measured part (the server compiled every step shape before it
answered /health: on the paged default a 64-token context makes that six, a mixed step per prefill
width and a decode call per power of two of rows), through its first weight update."""
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Tally:
    finished: dict[str, int] = field(default_factory=dict)
    """Final answers by finish type (stop, length, abort)."""
    refused: int = 0
    """503: queue full (the client backs off and re-sends)."""
    bad: list[str] = field(default_factory=list)
    """Anything else: a 5xx, a malformed reply, a lost connection."""
    rids: list[str] = field(default_factory=list)
    health_max_s: float = 0.0
    health_checks: int = 0
    pushes: int = 0
    first_push_done_s: float | None = None
    rss: list[tuple[float, float]] = field(default_factory=list)


async def _info(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/get_server_info") as r:
        return (await r.json())["internal_states"][0]


@pytest.mark.slow
def test_server_soak(tiny_dir: Path) -> None:
    seconds = float(os.environ.get("SOAK_SECONDS", "30"))
    warmup = WARMUP_S
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": xla_flags.FAST_COMPILE, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_jax.cli", "serve", "--model-path", str(tiny_dir), "--port", str(port),
         "--max-running-requests", "32", "--context-length", "64", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    tally = Tally()
    t_start = 0.0
    rng = random.Random(0)

    async def one(s: aiohttp.ClientSession, rid: str) -> None:
        payload = {"rid": rid, "input_ids": [rng.randrange(3, 60) for _ in range(rng.randint(2, 12))],
                   "return_logprob": True,
                   "sampling_params": {"max_new_tokens": rng.randint(1, 40), "temperature": 1.0}}
        if rng.random() < 0.03:  # a caller gives up on this one
            async def cancel() -> None:
                await asyncio.sleep(rng.uniform(0.0, 1.0))
                async with s.post(url + "/abort_request", json={"rid": rid}) as r:
                    assert r.status == 200
            asyncio.ensure_future(cancel())
        while True:
            try:
                async with s.post(url + "/generate", json=payload) as r:
                    status, body = r.status, (await r.json() if r.content_type == "application/json" else None)
            except (aiohttp.ClientError, TimeoutError) as e:
                tally.bad.append(f"{rid}: {type(e).__name__}: {e}")
                return
            if status == 503:
                tally.refused += 1
                await asyncio.sleep(0.2)
                continue
            if status != 200 or not isinstance(body, dict):
                tally.bad.append(f"{rid}: {status} {body}")
                return
            meta = body["meta_info"]
            kind = meta["finish_reason"]["type"]
            if kind not in ("stop", "length", "abort") or meta["id"] != rid or \
                    len(body["output_ids"]) != len(meta["output_token_logprobs"]):
                tally.bad.append(f"{rid}: {meta}")
                return
            tally.finished[kind] = tally.finished.get(kind, 0) + 1
            tally.rids.append(rid)
            return

    async def worker(s: aiohttp.ClientSession, w: int, deadline: float) -> None:
        n = 0
        while time.monotonic() < deadline:
            await one(s, f"w{w}-{n}")
            n += 1

    async def health(s: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            async with s.get(url + "/health") as r:
                assert r.status == 200, r.status
            tally.health_max_s = max(tally.health_max_s, time.monotonic() - t0)
            tally.health_checks += 1
            await asyncio.sleep(0.25)

    async def pusher(s: aiohttp.ClientSession, deadline: float) -> None:
        while True:
            await asyncio.sleep(max(0.0, min(PUSH_EVERY_S, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                return
            tally.pushes += 1
            for path, body in (("/pause_generation", {"mode": "abort"}),
                               ("/update_weights_from_disk", {"model_path": str(tiny_dir),
                                                              "weight_version": str(tally.pushes)}),
                               ("/continue_generation", {})):
                async with s.post(url + path, json=body) as r:
                    assert r.status == 200, (path, await r.text())
            if tally.first_push_done_s is None:
                tally.first_push_done_s = time.monotonic() - t_start

    async def sample_rss(stop: asyncio.Event) -> None:
        while not stop.is_set():
            tally.rss.append((time.monotonic() - t_start, resident_mib(proc.pid)))
            await asyncio.sleep(1.0)

    async def main() -> dict:
        await _wait_healthy(f"127.0.0.1:{port}", proc, timeout=600)  # compiles every step shape first
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=conn) as s:
            start = await _info(s, url)
            stop = asyncio.Event()
            nonlocal t_start
            t_start = time.monotonic()
            side = [asyncio.ensure_future(health(s, stop)), asyncio.ensure_future(sample_rss(stop))]
            deadline = time.monotonic() + warmup + seconds
            await asyncio.gather(pusher(s, deadline), *(worker(s, w, deadline) for w in range(CONCURRENCY)))
            for _ in range(100):  # the abort-by-rid tasks may still be landing
                end = await _info(s, url)
                if end["live_requests"] == 0 and end["free_slots"] == end["num_slots"]:
                    break
                await asyncio.sleep(0.1)
            stop.set()
            await asyncio.gather(*side)
            async with s.get(url + "/get_model_info") as r:
                version = (await r.json())["weight_version"]
        return {"start": start, "end": end, "version": version}

    try:
        out = asyncio.run(main())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    start, end = out["start"], out["end"]
    rss = [m for _, m in tally.rss]
    warm = [m for t, m in tally.rss if t >= max(warmup, tally.first_push_done_s or 0.0)] or rss
    print(f"\nsoak {seconds:.0f}s after {warmup:.0f}s of warm-up: {sum(tally.finished.values())} requests "
          f"answered {tally.finished}, "
          f"{tally.refused} refusals (503), {len(tally.bad)} bad; {tally.pushes} weight updates; "
          f"RSS MiB start {rss[0]:.0f}, after warm-up {warm[0]:.0f}, end {rss[-1]:.0f}, max {max(rss):.0f}; "
          f"health: {tally.health_checks} checks, max latency {tally.health_max_s * 1e3:.0f} ms; "
          f"slots free {start['free_slots']}/{start['num_slots']} at start, "
          f"{end['free_slots']}/{end['num_slots']} at end, live requests at end {end['live_requests']}")
    assert not tally.bad, tally.bad[:5]
    assert len(tally.rids) == len(set(tally.rids))  # one final answer per rid
    assert sum(tally.finished.values()) >= CONCURRENCY
    assert tally.pushes >= int((warmup + seconds) // PUSH_EVERY_S) // 2
    assert out["version"] == str(tally.pushes)
    if tally.pushes:
        assert tally.finished.get("abort", 0) > 0  # the pauses did abort requests in flight
    assert start["free_slots"] == start["num_slots"] and end["free_slots"] == end["num_slots"]
    assert end["live_requests"] == 0 and end["num_waiting"] == 0 and end["num_running"] == 0
    assert rss[-1] - warm[0] < max(0.1 * warm[0], 64.0), (warm[0], rss[-1])
    assert tally.health_checks > seconds and tally.health_max_s < 5.0
