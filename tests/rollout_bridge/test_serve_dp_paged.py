"""``areal-jax serve --kv-cache paged --dp-size 2 --tp-size 2`` over real HTTP, on four of the
eight fake CPU devices: two replicas of the paged engine, each tensor-parallel over its own two
devices with its own page pool, behind one server. ``/get_server_info`` reports dp as SGLang
does (one internal state per rank, the per-rank pool at the top level), requests reach both
replicas and decode as the full forward pass does, a pause reaches both, and a weight update from
disk reaches both with one version label in every reply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import load_pretrained
from areal_jax.models.hf_write import save_pretrained
from tests.inference.reference import reference_greedy

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs four devices (tests/conftest.py fakes eight)")


def _v1_checkpoint(tiny_dir: Path, out: Path) -> Path:
    model = load_pretrained(tiny_dir)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 3 if x.ndim == 2 else x, params))
    return save_pretrained(model, out, tokenizer_dir=tiny_dir)


@pytest.mark.slow
def test_paged_data_parallel_server(tiny_dir: Path, tmp_path: Path) -> None:
    from rollout_bridge.serve import build, parser
    from rollout_bridge.server import start_server

    v1 = _v1_checkpoint(tiny_dir, tmp_path / "v1")
    args = parser().parse_args(["--model-path", str(tiny_dir), "--kv-cache", "paged", "--dp-size", "2",
                                "--tp-size", "2", "--max-running-requests", "8", "--max-total-tokens", "256",
                                "--page-size", "16", "--context-length", "64", "--random-seed", "3",
                                "--skip-server-warmup", "--weight-roots", str(tmp_path)])
    prompts = [[5, 17, 3, 42], [9, 8, 7], [100, 101, 102, 103, 104], [1, 2]]

    async def go() -> dict:
        app, engine = build(args)
        runner, port = await start_server(app, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                async def post(path: str, body: dict) -> dict:
                    async with http.post(url + path, json=body) as r:
                        assert r.status == 200, await r.text()
                        return json.loads(await r.text())

                async def generate(p: list[int]) -> dict:
                    return await post("/generate", {"input_ids": p, "sampling_params": {
                        "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, "return_logprob": True})

                async with http.get(url + "/get_server_info") as r:
                    info = await r.json()
                before = await asyncio.gather(*(generate(p) for p in prompts))
                finished = [r.stats["finished_requests"] for r in engine.replicas]
                await post("/pause_generation", {"mode": "in_place"})
                paused = [r.paused for r in engine.replicas]
                await post("/continue_generation", {})
                update = await post("/update_weights_from_disk", {"model_path": str(v1), "weight_version": "v1"})
                after = await generate(prompts[0])
                async with http.get(url + "/get_server_info") as r:
                    info_after = await r.json()
                return {"info": info, "before": before, "finished": finished, "paused": paused, "update": update,
                        "after": after, "info_after": info_after,
                        "versions": [r.version for r in engine.replicas]}
        finally:
            await runner.cleanup()

    out = asyncio.run(go())
    info = out["info"]
    assert info["dp_size"] == 2 and info["tp_size"] == 2
    assert info["max_total_num_tokens"] == 256 and info["max_running_requests"] == 8  # per rank, as SGLang
    states = info["internal_states"]
    assert [s["dp_rank"] for s in states] == [0, 1]
    for s in states:
        assert s["max_total_num_tokens"] == 256 and s["placement"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2}
    assert states[0]["random_seed"] != states[1]["random_seed"]
    assert all(n >= 1 for n in out["finished"]) and sum(out["finished"]) == len(prompts)  # both replicas served
    model = load_pretrained(tiny_dir)
    for p, reply in zip(prompts, out["before"], strict=True):
        assert reply["output_ids"] == reference_greedy(model, p, 8)
        assert reply["meta_info"]["weight_version"] == "default"
    assert out["paused"] == ["in_place", "in_place"]
    assert out["update"]["success"] and out["versions"] == [1, 1]
    assert out["after"]["meta_info"]["weight_version"] == "v1"
    assert out["after"]["output_ids"] == reference_greedy(load_pretrained(v1), prompts[0], 8)
    assert [s["engine_version"] for s in out["info_after"]["internal_states"]] == [1, 1]
    assert {s["weight_version"] for s in out["info_after"]["internal_states"]} == {"v1"}
    assert np.isfinite([lp for lp, _, _ in out["after"]["meta_info"]["output_token_logprobs"]]).all()
