"""Weight pushes end to end: every dtype the trainer can hold goes through both sinks and serves
exactly the pushed weights; the client records what each server holds, notices a restarted
server and keeps it out of rotation until it holds the current version."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import iter_hf_tensors, load_pretrained
from areal_jax.models.hf_io import assign_hf_tensors
from rollout_bridge.client import ClientConfig, HttpRolloutClient, WeightUpdateError
from rollout_bridge.streamer import DiskSink, HttpBucketSink
from tests.inference.reference import reference_logprobs
from tests.ports import free_port
from tests.rollout_bridge.bridge_helpers import running_server

SP = {"max_new_tokens": 8, "temperature": 0.8, "ignore_eos": True}


def _roots(tmp_path: Path) -> dict:
    """The servers load pushed checkpoints from under the test's directory."""
    return {"weight_roots": [tmp_path]}


def _trained(tiny_dir: Path, scale: float) -> object:
    model = load_pretrained(tiny_dir)
    nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_through_both_sinks(tiny_dir: Path, tmp_path: Path, dtype: str) -> None:
    def version_weights(version: int) -> tuple[object, list, object]:
        """Weights of their own per version (so a push that changed nothing shows), as the trainer
        holds them, as HF tensors in ``dtype``, and as the served (float32) model holds them."""
        new = _trained(tiny_dir, 1.0 + 0.15 * version)
        tensors = list(iter_hf_tensors(new, dtype))
        assert {a.dtype.name for _, a in tensors} == {dtype}
        pushed = load_pretrained(tiny_dir)
        assign_hf_tensors(pushed, dict(tensors))
        return new, tensors, pushed

    prompt = [5, 17, 3, 42]

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, app_kw=_roots(tmp_path)) as (addr, engine), \
                HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=30)) as client:
            url = f"http://{addr}"
            config = load_pretrained(tiny_dir).config.to_hf_dict(dtype)
            sinks = [HttpBucketSink(client, bucket_bytes=16 * 1024),
                     DiskSink(tmp_path / "w", config, client=client, tokenizer_dir=tiny_dir)]
            # Each sink takes a plain iterator (collected, or sent a bucket behind its look-ahead)
            # and the streamer's stream, whose layout lets it lay the file or the buckets out first;
            # the HTTP sink also the stream in our own kernel layout (what a run sends it).
            pushes = [(sink, source) for sink in sinks for source in ("plain", "stream")]
            pushes.insert(2, (sinks[0], "native"))
            before = None
            for version, (sink, source) in enumerate(pushes, start=1):
                new, tensors, pushed = version_weights(version)
                stream = iter(tensors) if source == "plain" else iter_hf_tensors(new, dtype,
                                                                                hf_layout=source != "native")
                assert hasattr(stream, "layout") == (source != "plain")
                metrics = await sink.push(version, stream)
                assert metrics.servers == 1 and client.server_versions() == {url: version}
                assert metrics.tensors == len(tensors) and metrics.bytes == sum(a.nbytes for _, a in tensors)
                if isinstance(sink, HttpBucketSink):
                    assert metrics.buckets > 1
                r = await client.generate(prompt, SP)
                assert r.output_versions == [version] * 8
                want = reference_logprobs(pushed, prompt, r.output_ids, 0.8)
                np.testing.assert_allclose(r.output_logprobs, want, atol=1e-4)
                if before is not None:  # the previous version's weights would score these tokens otherwise
                    assert np.abs(reference_logprobs(before, prompt, r.output_ids, 0.8) - want).max() > 1e-3
                before = pushed
            assert (await client.reported_versions()) == {url: str(len(pushes))}
            with pytest.raises(ValueError, match="hf_layout=True"):  # a checkpoint on disk is HF, always
                await sinks[1].push(99, iter_hf_tensors(before, dtype, hf_layout=False))
            assert client.server_versions() == {url: len(pushes)}

    asyncio.run(main())


@pytest.mark.slow
def test_restarted_server_is_out_of_rotation_until_it_holds_the_current_version(tiny_dir: Path,
                                                                               tmp_path: Path) -> None:
    new = _trained(tiny_dir, 1.2)
    port_b = free_port()
    cfg = ClientConfig(control_timeout_s=30, health_interval_s=0.1, all_down_wait_s=10)

    async def wait_for(cond) -> None:  # noqa: ANN001
        for _ in range(500):
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("condition not reached")

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64, app_kw=_roots(tmp_path)) as (a, _), \
                contextlib.AsyncExitStack() as stack:
            url_a, url_b = f"http://{a}", f"http://127.0.0.1:{port_b}"

            async def start_b() -> tuple[contextlib.AsyncExitStack, object]:
                b_stack = contextlib.AsyncExitStack()
                _, engine_b = await b_stack.enter_async_context(
                    running_server(tiny_dir, max_seq_len=64, app_kw=_roots(tmp_path), port=port_b))
                return b_stack, engine_b

            b_stack, _ = await start_b()
            client = await stack.enter_async_context(HttpRolloutClient([a, f"127.0.0.1:{port_b}"], config=cfg))
            await HttpBucketSink(client).push(1, iter_hf_tensors(new))
            assert client.server_versions() == {url_a: 1, url_b: 1} and client.in_rotation() == [url_a, url_b]

            await b_stack.aclose()  # B restarts, back at its initial weights ("default")
            b_stack, engine_b = await start_b()
            await wait_for(lambda: client.server_versions()[url_b] == 0)
            assert client.in_rotation() == [url_a]
            results = await asyncio.gather(*(client.generate([3, i], SP) for i in range(4)))
            assert all(r.output_versions == [1] * 8 for r in results)
            assert engine_b.stats["generated_tokens"] == 0

            await HttpBucketSink(client).push(2, iter_hf_tensors(new))  # the next push brings it back
            assert client.server_versions() == {url_a: 2, url_b: 2} and client.in_rotation() == [url_a, url_b]
            sink = DiskSink(tmp_path / "w", new.config.to_hf_dict("float32"), client=client, tokenizer_dir=tiny_dir)
            await sink.push(3, iter_hf_tensors(new))

            await b_stack.aclose()  # after a disk push, a restarted server is reloaded at once
            b_stack, engine_b = await start_b()
            stack.push_async_callback(b_stack.aclose)
            await wait_for(lambda: client.server_versions()[url_b] == 3 and engine_b.version == 1)
            assert client.in_rotation() == [url_a, url_b]
            r = await client.generate([3, 4], SP)
            assert r.output_versions == [3] * 8

    asyncio.run(main())


@pytest.mark.parametrize("max_staleness", [2, 0])
def test_overlapped_push_serves_its_own_version_while_the_next_update_runs(tiny_dir: Path, tmp_path: Path,
                                                                          max_staleness: int) -> None:
    """The RL loop's push in async mode (``rollout.overlap_weight_push``): ``WeightPush.start`` returns
    with the controller at the new version (at once, or with ``max_staleness`` 0 once the server
    has paused), and the push streams on from lent params while the next update runs. The server
    must end up with exactly the weights the push started with, not the ones that update wrote
    meanwhile (nor fail on donated arrays)."""
    from areal_jax.algo import AlgoConfig
    from areal_jax.controller import RolloutController
    from areal_jax.trainer import TrainConfig, Trainer
    from areal_jax.trainer.run_config import load_run_config
    from areal_jax.trainer.weight_push import WeightPush
    from tests.trainer.helpers import random_trajectories

    demo = Path(__file__).parents[2] / "configs" / "demo.yaml"
    cfg = load_run_config(demo, ["warm_start=null", f"run_dir={tmp_path}", f"rollout.max_staleness={max_staleness}"])
    assert cfg.rollout.mode == "async" and cfg.rollout.overlap_weight_push
    trainer = Trainer(load_pretrained(tiny_dir), AlgoConfig(),
                      TrainConfig(micro_batch_tokens=64, length_buckets=(64,), lr=1e-2))
    rng = np.random.default_rng(0)
    trainer.train_batch(random_trajectories(rng, 2, 4), 0)
    version_1 = trainer.model(jax.tree.map(lambda x: x.copy(), trainer.policy.params))  # a copy of its own
    controller = RolloutController(None, None, iter(()), batch_size=2, max_staleness=max_staleness)
    prompt = [5, 17, 3, 42]

    async def main() -> tuple[list, list[float]]:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, _), \
                HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=30)) as client:
            # Small buckets: the push takes many round trips, so the update below runs inside it.
            pushing = await WeightPush(cfg, trainer, client, HttpBucketSink(client, bucket_bytes=4096),
                                       controller).start(1, step=1)
            assert controller.version == 1 and not pushing.done()
            await asyncio.gather(pushing, asyncio.to_thread(trainer.train_batch, random_trajectories(rng, 2, 4), 1))
            r = await client.generate(prompt, SP)
            assert r.output_versions == [1] * 8 and client.server_versions() == {f"http://{addr}": 1}
            return r.output_ids, r.output_logprobs

    ids, logprobs = asyncio.run(main())
    want = reference_logprobs(version_1, prompt, ids, 0.8)
    np.testing.assert_allclose(logprobs, want, atol=1e-4)
    # The update that ran meanwhile did change the weights: serving them would have shown.
    assert np.abs(reference_logprobs(trainer.model(), prompt, ids, 0.8) - want).max() > 1e-3


def test_held_push_serves_the_old_weights_until_the_commit(tiny_dir: Path, tmp_path: Path) -> None:
    """``HttpBucketSink.push(hold=True)``: the server builds the version while it goes on serving
    (and stamping) the old one; ``commit`` swaps it in, inside a pause of its own, after which the
    new weights answer. A commit that names no held transfer is refused, naming the field, and
    changes nothing."""
    prompt = [5, 17, 3, 42]
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def main() -> None:
        async with running_server(tiny_dir, max_seq_len=64) as (addr, engine), \
                HttpRolloutClient([addr], config=ClientConfig(control_timeout_s=30)) as client:
            url = f"http://{addr}"
            sink = HttpBucketSink(client, bucket_bytes=16 * 1024)
            old = load_pretrained(tiny_dir)
            new = _trained(tiny_dir, 1.4)
            before = await client.generate(prompt, greedy)
            metrics = await sink.push(1, iter_hf_tensors(new, "float32", hf_layout=False), hold=True)
            assert metrics.buckets > 1 and sink.held_version == 1
            held = await client.generate(prompt, greedy)  # still the old weights, stamped as such
            assert held.output_ids == before.output_ids and held.output_versions == [0] * 6
            assert client.server_versions() == {url: 0} and engine.version == 0
            assert await client.reported_versions() == {url: "default"}
            sampled = await client.generate(prompt, SP)
            np.testing.assert_allclose(sampled.output_logprobs,
                                       reference_logprobs(old, prompt, sampled.output_ids, 0.8), atol=1e-4)

            with pytest.raises(WeightUpdateError, match="transfer_id: no held transfer 'nope'"):
                await client.commit_weights(1, "nope")
            assert engine.version == 0 and client.server_versions() == {url: 0}

            # The commit pauses the server itself (abort) around the swap: an answer in flight is
            # aborted, re-sent by the client and finished under the new weights.
            task = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 40, "temperature": 1.0,
                                                                "ignore_eos": True}, rid="long"))
            live = engine._live  # noqa: SLF001

            async def started() -> None:
                while "long" not in live or len(live["long"].out_ids) < 5:
                    await asyncio.sleep(0.002)

            await asyncio.wait_for(started(), 30)
            t = engine.stats["paused_seconds"]
            await sink.commit(1, pause_mode="abort")
            assert engine.stats["paused_seconds"] > t and engine.paused is None  # paused, and continued
            long = await task
            vs = np.array(long.output_versions)
            assert len(vs) == 40 and long.resends >= 1 and set(vs.tolist()) == {0, 1} and (np.diff(vs) >= 0).all()
            assert client.server_versions() == {url: 1} and engine.version == 1 and sink.held_version is None
            assert await client.reported_versions() == {url: "1"}
            after = await client.generate(prompt, SP)
            assert after.output_versions == [1] * 8
            np.testing.assert_allclose(after.output_logprobs,
                                       reference_logprobs(new, prompt, after.output_ids, 0.8), atol=1e-4)
            with pytest.raises(RuntimeError, match="not pushed with hold"):
                await sink.commit(1)
            # a server the client paused stays paused through a commit, until continued
            await sink.push(2, iter_hf_tensors(old, "float32", hf_layout=False), hold=True)
            await client.pause("abort")
            await sink.commit(2, pause_mode="abort")
            assert engine.version == 2 and engine.paused == "abort"
            await client.continue_generation()
            assert engine.paused is None and (await client.generate(prompt, greedy)).output_ids == before.output_ids

    asyncio.run(main())
