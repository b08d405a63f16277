"""The embedded server and the rollout client end to end on a tiny checkpoint (real HTTP, 127.0.0.1)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import iter_hf_tensors, load_pretrained
from rollout_bridge.client import ClientConfig, HttpRolloutClient, WeightUpdateError
from rollout_bridge.streamer import DiskSink
from tests.inference.reference import reference_greedy, reference_logprobs
from tests.rollout_bridge.bridge_helpers import ServerThread, running_server

PROMPTS = [[5, 17, 3, 42], [9, 11, 60, 2, 33, 7], [14], [70, 71, 72, 73, 74, 75, 76, 77]]


def _cfg() -> ClientConfig:
    return ClientConfig(generate_timeout_s=120, control_timeout_s=30, weight_timeout_s=120, all_down_wait_s=5)


def test_greedy_and_logprobs_match_full_forward(server: ServerThread, tiny_dir: Path) -> None:
    addr = server.addr
    model = load_pretrained(tiny_dir)
    eos = model.config.eos_token_ids

    async def main() -> None:
        async with HttpRolloutClient([addr], config=_cfg()) as client:
            greedy = await asyncio.gather(*(client.generate(p, {"max_new_tokens": 12, "temperature": 0.0})
                                            for p in PROMPTS))
            for p, r in zip(PROMPTS, greedy, strict=True):
                assert r.output_ids == reference_greedy(model, p, 12, eos)
                assert r.output_versions == [0] * len(r.output_ids)
            sampled = await asyncio.gather(*(client.generate(p, {"max_new_tokens": 16, "temperature": 0.7,
                                                                 "ignore_eos": True}) for p in PROMPTS))
            for p, r in zip(PROMPTS, sampled, strict=True):
                assert len(r.output_ids) == 16 and r.finish_reason == {"type": "length", "length": 16}
                ref = reference_logprobs(model, p, r.output_ids, 0.7)
                np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)

    asyncio.run(main())


def test_64_concurrent_requests_none_lost(tiny_dir: Path) -> None:
    async def main() -> None:
        async with running_server(tiny_dir, num_slots=16) as (addr, _), \
                HttpRolloutClient([addr], config=_cfg()) as client:
            rids = [f"req-{i}" for i in range(64)]
            res = await asyncio.gather(*(client.generate([1 + i % 50, 2, 3], {"max_new_tokens": 8, "ignore_eos": True},
                                                         rid=rid) for i, rid in enumerate(rids)))
            assert sorted(r.rid for r in res) == sorted(rids)
            assert all(len(r.output_ids) == 8 == len(r.output_logprobs) for r in res)

    asyncio.run(main())


def test_update_weight_version_relabels_without_new_weights(server: ServerThread, tiny_dir: Path) -> None:
    addr = server.addr
    async def main() -> None:
        async with HttpRolloutClient([addr], config=_cfg()) as client:
            before = await client.generate([4, 5, 6], {"max_new_tokens": 6, "temperature": 0})
            await client.update_weight_version(7)
            assert await client.versions() == {f"http://{addr}": 7}
            after = await client.generate([4, 5, 6], {"max_new_tokens": 6, "temperature": 0})
            assert after.output_versions == [7] * 6 and before.output_versions == [0] * 6
            assert after.output_ids == before.output_ids  # same weights, only the label moved

    asyncio.run(main())


@pytest.mark.slow
def test_pause_update_from_disk_continue(tiny_dir: Path, tmp_path: Path) -> None:
    """An answer that spans a weight update: new tokens carry the new version and its logprobs."""
    old = load_pretrained(tiny_dir)
    new = load_pretrained(tiny_dir)
    state = nnx.state(new, nnx.Param)
    nnx.update(new, __import__("jax").tree.map(lambda x: x * 1.5, state))
    sink_dir = tmp_path / "weights"

    async def main() -> None:
        async with running_server(tiny_dir, app_kw={"weight_roots": [sink_dir]}) as (addr, engine), \
                HttpRolloutClient([addr], config=_cfg()) as client:
            sink = DiskSink(sink_dir, new.config.to_hf_dict("float32"), client=client, tokenizer_dir=tiny_dir)
            prompt = PROMPTS[1]
            task = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 100, "temperature": 1.0,
                                                                "ignore_eos": True}))
            # wait until version 0 has sampled a token of it (a request holds its seat while its
            # first step compiles, which on a loaded machine outlasts any fixed wait)
            while engine.stats["generated_tokens"] == 0:
                await asyncio.sleep(0.01)
            await client.pause("abort")
            metrics = await sink.push(1, iter_hf_tensors(new, "float32"))
            assert metrics.servers == 1 and engine.version == 1
            await client.continue_generation()
            r = await task
            assert len(r.output_ids) == 100
            assert r.resends >= 1
            vs = np.array(r.output_versions)
            assert set(vs.tolist()) == {0, 1} and (np.diff(vs) >= 0).all(), vs
            k = int((vs == 0).sum())
            lp_old = reference_logprobs(old, prompt, r.output_ids, 1.0)
            lp_new = reference_logprobs(new, prompt, r.output_ids, 1.0)
            np.testing.assert_allclose(r.output_logprobs[:k], lp_old[:k], atol=1e-4)
            np.testing.assert_allclose(r.output_logprobs[k:], lp_new[k:], atol=1e-4)
            assert (await client.versions()) == {f"http://{addr}": 1}

    asyncio.run(main())


def test_bad_requests_auth_and_failed_weight_load(tiny_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        roots = {"weight_roots": [tmp_path]}  # the broken checkpoint below is loaded (and fails)
        async with running_server(tiny_dir, api_key="sekret", max_seq_len=64, app_kw=roots) as (addr, engine):
            url = f"http://{addr}"
            auth = {"Authorization": "Bearer sekret"}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.get(url + "/health") as r:
                    assert r.status == 200  # open without a key
                async with s.post(url + "/generate", json={"input_ids": [1, 2]}) as r:
                    assert r.status == 401
                async with s.post(url + "/generate", json={"input_ids": [1, 2]},
                                  headers={"Authorization": "Bearer wrong"}) as r:
                    assert r.status == 401
                bad = [
                    ({"input_ids": [1], "sampling_params": {"tempurature": 1.0}}, "tempurature"),
                    ({"input_ids": []}, "input_ids"),
                    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
                    ({"input_ids": [1], "sampling_params": {"temperature": 1e39}}, "temperature"),
                    ({"input_ids": list(range(1, 65))}, "input_ids"),
                    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
                    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
                    ({"input_ids": [1000]}, "input_ids"),
                ]
                for body, field in bad:
                    async with s.post(url + "/generate", json=body, headers=auth) as r:
                        msg = (await r.json())["error"]["message"]
                        assert r.status == 400 and field in msg, (body, r.status, msg)
                async with s.post(url + "/generate", data=b"{not json", headers=auth) as r:
                    assert r.status == 400
                async with s.post(url + "/pause_generation", json={"mode": "sideways"}, headers=auth) as r:
                    assert r.status == 400 and "mode" in (await r.json())["error"]["message"]

            cfg = _cfg()
            async with HttpRolloutClient([addr], api_key="sekret", config=cfg) as client:
                before = await client.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 0})
                (tmp_path / "broken").mkdir()
                (tmp_path / "broken" / "config.json").write_text("{}")
                with pytest.raises(WeightUpdateError, match="no model.safetensors"):
                    await client.update_weights_from_disk(str(tmp_path / "broken"), version=5)
                assert engine.version == 0
                after = await client.generate([5, 6, 7], {"max_new_tokens": 6, "temperature": 0})
                assert after.output_ids == before.output_ids and after.output_versions == [0] * 6

    asyncio.run(main())
