"""A weight update that fails on a server (a path outside its weight roots, a truncated
safetensors file): that server keeps serving its old weights, leaves rotation until a later push
reaches it, and every token is stamped with the version its server really held, checked against
each version's own logprobs. Two real servers."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest

from areal_jax.models import iter_hf_tensors, load_pretrained
from areal_jax.models.tiny import make_tiny_checkpoint
from rollout_bridge.client import ClientConfig, GenerateResult, HttpRolloutClient, WeightUpdateError
from rollout_bridge.streamer import HttpBucketSink
from tests.inference.reference import reference_logprobs
from tests.rollout_bridge.bridge_helpers import running_server

CFG = ClientConfig(generate_timeout_s=60, control_timeout_s=10, all_down_wait_s=5, health_interval_s=3600)
SP = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0}


def _matches(model: object, r: GenerateResult) -> bool:
    ref = reference_logprobs(model, r.input_ids, r.output_ids, 1.0)
    return float(np.abs(ref - np.asarray(r.output_logprobs)).max()) < 1e-4


def test_failed_weight_update_keeps_old_weights_and_the_server_out_of_rotation(tiny_dir: Path,
                                                                                tmp_path: Path) -> None:
    run = tmp_path / "run"
    v1_dir = make_tiny_checkpoint(run / "v1", model_type="qwen2", size="tiny", seed=1)  # other weights
    truncated = run / "v2"
    shutil.copytree(v1_dir, truncated)
    st_file = truncated / "model.safetensors"
    st_file.write_bytes(st_file.read_bytes()[: st_file.stat().st_size // 2])
    (tmp_path / "elsewhere").mkdir()
    base, v1 = load_pretrained(tiny_dir), load_pretrained(v1_dir)

    async def generate(client: HttpRolloutClient, n: int) -> list[GenerateResult]:
        return await asyncio.wait_for(asyncio.gather(*(client.generate([5, 6, 7 + i], SP) for i in range(n))), 60)

    async def main() -> None:
        # server b may load only from a directory the run does not write to: every disk push fails there
        async with running_server(tiny_dir, app_kw={"weight_roots": [str(run)]}) as (a, ea), \
                running_server(tiny_dir, app_kw={"weight_roots": [str(tmp_path / "elsewhere")]}) as (b, eb), \
                HttpRolloutClient([a, b], config=CFG) as client:
            url_a, url_b = f"http://{a}", f"http://{b}"
            # 1. a bad path on one server: the other takes the version, the failed one keeps its own
            with pytest.raises(WeightUpdateError, match=rf"{b}.*weight roots"):
                await client.update_weights_from_disk(str(v1_dir), version=1)
            assert (ea.version, eb.version) == (1, 0)
            assert client.server_versions() == {url_a: 1, url_b: 0} and client.in_rotation() == [url_a]
            assert (await client.reported_versions()) == {url_a: "1", url_b: "default"}
            b_done = eb.stats["finished_requests"]
            results = await generate(client, 6)
            assert eb.stats["finished_requests"] == b_done  # nothing went to the server left behind
            assert all(r.output_versions == [1] * 6 and _matches(v1, r) for r in results)

            # 2. a truncated safetensors file fails on both: nobody moves, the version is not bumped
            with pytest.raises(WeightUpdateError, match=r"failed on .*\(400\)"):
                await client.update_weights_from_disk(str(truncated), version=2)
            assert (ea.version, eb.version) == (1, 0) and client.current_version == 1
            assert client.server_versions() == {url_a: 1, url_b: 0}
            results = await generate(client, 4)
            assert all(r.output_versions == [1] * 6 and _matches(v1, r) for r in results)  # a still serves v1

            # 3. with the up-to-date server gone, the old one answers, stamped with what it holds
            client.mark_down(client.servers[0], "gone")  # as a failed call would
            results = await generate(client, 3)
            assert all(r.output_versions == [0] * 6 and _matches(base, r) and not _matches(v1, r) for r in results)

            # 4. the next push that reaches it brings it back, both serving the same weights
            assert await client.check_health() == [True, True]
            await HttpBucketSink(client).push(3, iter_hf_tensors(v1))
            assert client.server_versions() == {url_a: 3, url_b: 3} and client.in_rotation() == [url_a, url_b]
            b_done = eb.stats["finished_requests"]
            results = await generate(client, 8)
            assert eb.stats["finished_requests"] > b_done
            assert all(r.output_versions == [3] * 6 and _matches(v1, r) for r in results)

    asyncio.run(main())


def test_bucket_refused_by_one_server_still_reaches_the_others(tiny_dir: Path, tmp_path: Path) -> None:
    """A multi-bucket HTTP push that one server refuses (its body bound is too small): the other
    gets every bucket and the version, the refusing one keeps its old weights and leaves rotation,
    and the push reports it. Before, the first refused bucket stopped the transfer for everyone."""
    v1 = load_pretrained(make_tiny_checkpoint(tmp_path / "v1", model_type="qwen2", size="tiny", seed=1))

    async def main() -> None:
        async with running_server(tiny_dir) as (a, ea), \
                running_server(tiny_dir, app_kw={"max_body_bytes": 64 * 1024}) as (b, eb), \
                HttpRolloutClient([a, b], config=CFG) as client:
            url_a, url_b = f"http://{a}", f"http://{b}"
            sink = HttpBucketSink(client, bucket_bytes=96 * 1024)  # four buckets, each past b's bound
            with pytest.raises(WeightUpdateError, match=rf"version 1 failed on {url_b} \(413\)") as e:
                await sink.push(1, iter_hf_tensors(v1))
            assert set(e.value.failed) == {url_b}
            assert (ea.version, eb.version) == (1, 0)
            assert client.server_versions() == {url_a: 1, url_b: 0} and client.in_rotation() == [url_a]
            results = await asyncio.wait_for(asyncio.gather(*(client.generate([5, 6, i], SP) for i in range(4))), 60)
            assert all(r.output_versions == [1] * 6 and _matches(v1, r) for r in results)

    asyncio.run(main())
