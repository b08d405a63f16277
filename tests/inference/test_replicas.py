"""Data-parallel replicas of the paged engine (``inference.replicas``) on fake CPU devices: each
replica runs on its own device with its own page pool and takes requests (a group's answers on
one, sharing its prompt's pages), answers equal one engine's, and a pause, an abort and a weight
update reach every replica (per-token version stamps, each token computed under the weights that
made it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest

from areal_jax.inference import Engine, EngineConfig, GenerateRequest, SamplingParams
from areal_jax.inference.replicas import ReplicaEngine
from areal_jax.models.decoder import Decoder
from areal_jax.models.hf_io import load_pretrained
from tests.inference.reference import assert_no_page_leaked, joined, prompts, reference_greedy, reference_logprobs, run

pytestmark = pytest.mark.skipif(jax.device_count() < 2, reason="needs two devices (tests/conftest.py fakes eight)")

# per replica, as SGLang sizes a dp rank: 8 running requests, 24 pages of 4 tokens
CFG = EngineConfig(num_slots=8, max_seq_len=64, max_prefill_batch=4, decode_steps=4, seed=0, kv_cache="paged",
                   page_size=4, max_total_tokens=96, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def replicas(ckpt: Path) -> ReplicaEngine:
    engine = ReplicaEngine.build(lambda mesh: load_pretrained(ckpt, mesh=mesh), CFG, dp_size=2,
                                 devices=jax.devices()[:2])
    # compiled before the tests: a replica compiling its first step while the other decodes would
    # let one answer run to its end before the other's first token
    engine.warmup()
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def _devices(engine: Engine) -> set:
    return {d for x in jax.tree.leaves(engine.state) for d in x.devices()}


def test_replicas_have_their_own_devices_pools_and_seeds(replicas: ReplicaEngine) -> None:
    a, b = replicas.replicas
    assert _devices(a) == {jax.devices()[0]} and _devices(b) == {jax.devices()[1]}
    assert a.allocator is not b.allocator
    assert a.allocator.max_total_tokens == b.allocator.max_total_tokens == 96  # per replica, not split
    assert a.cfg.num_slots == b.cfg.num_slots == 8
    assert (a.seed, b.seed) == (0, 1)  # unseeded requests draw from different streams on each
    info = replicas.server_info()
    assert info["dp_size"] == 2 and info["max_total_num_tokens"] == 96 and info["max_running_requests"] == 8
    assert [s["dp_rank"] for s in replicas.replica_states()] == [0, 1]


def test_both_replicas_take_requests_and_answer_as_one_engine(replicas: ReplicaEngine, ckpt: Path,
                                                               model: Decoder) -> None:
    """Distinct prompts alternate between the replicas (least loaded first); a group of four
    answers to one prompt stays on one replica, which prefills the prompt once. Greedy and seeded
    sampled answers, tokens and logprobs, equal a single paged engine's and the reference's."""
    ps = prompts([3, 5, 9, 17, 8, 4], seed=21)
    group = prompts([11], seed=22)[0]
    sampled = SamplingParams(max_new_tokens=10, temperature=0.9, seed=7, ignore_eos=True)
    reqs = ([GenerateRequest(p, greedy(10)) for p in ps] + [GenerateRequest(group, greedy(10)) for _ in range(4)]
            + [GenerateRequest(ps[0], sampled)])
    before = [dict(r.stats) for r in replicas.replicas]

    async def go() -> tuple[list, list[int]]:
        await replicas.start()
        try:
            tasks = [asyncio.create_task(replicas.generate(r)) for r in reqs]
            await asyncio.sleep(0)  # every request admitted and routed
            where = [replicas.replica_of(r.rid) for r in reqs]
            return await asyncio.gather(*tasks), where
        finally:
            await replicas.stop()

    outs, where = run(go())
    assert where[:6] == [0, 1, 0, 1, 0, 1]
    assert len(set(where[6:10])) == 1  # the group on one replica
    home = replicas.replicas[where[6]]
    assert home.stats["shared_prompt_tokens"] > before[where[6]]["shared_prompt_tokens"]
    for i, r in enumerate(replicas.replicas):
        assert r.stats["finished_requests"] - before[i]["finished_requests"] == where.count(i)
        assert r.num_live == 0
        assert_no_page_leaked(r)
    single = Engine(load_pretrained(ckpt), CFG)
    from tests.inference.reference import generate_all

    alone = generate_all(single, [GenerateRequest(r.input_ids, r.sampling) for r in reqs])
    for r, out, ref in zip(reqs, outs, alone, strict=True):
        assert out.output_ids == ref.output_ids, r.input_ids
        np.testing.assert_allclose(out.output_logprobs, ref.output_logprobs, rtol=0, atol=1e-5)
    for r, out in zip(reqs[:10], outs[:10], strict=True):
        assert out.output_ids == reference_greedy(model, r.input_ids, 10)
        np.testing.assert_allclose(out.output_logprobs, reference_logprobs(model, r.input_ids, out.output_ids, 0),
                                   atol=1e-4)


def test_weight_update_reaches_every_replica_mid_answer(replicas: ReplicaEngine, model: Decoder, ckpt: Path,
                                                        ckpt_v1: Path) -> None:
    """An answer on each replica; pause(retract) and a weight update to v1 mid-answer, then
    resume: on both, the tokens before carry version 0 and the v0 model's logprobs, those after
    carry 1 and the v1 model's, and both replicas serve version 1."""
    model_v1 = load_pretrained(ckpt_v1)
    ps = prompts([7, 6], seed=23)
    N = 48  # noqa: N806 - long enough that neither answer ends before the update

    async def go() -> list:
        await replicas.start()
        try:
            streams = [replicas.stream(GenerateRequest(p, greedy(N))) for p in ps]
            pieces = [[o] for o in await asyncio.gather(*(anext(s) for s in streams))]  # both admitted at once
            assert {replicas.replica_of(rid) for rid in replicas._where} == {0, 1}  # noqa: SLF001
            await replicas.pause("retract")
            assert all(r.paused == "retract" for r in replicas.replicas)
            await replicas.update_weights(model_dir=str(ckpt_v1), version=1)
            assert [r.version for r in replicas.replicas] == [1, 1] and replicas.version == 1
            await replicas.resume()
            for s, got in zip(streams, pieces, strict=True):
                got += [o async for o in s]
            return [joined(got) for got in pieces]
        finally:
            await replicas.update_weights(model_dir=str(ckpt), version=0)
            await replicas.stop()

    for p, out in zip(ps, run(go()), strict=True):
        k = out.output_versions.count(0)
        assert 1 <= k < N and out.output_versions == [0] * k + [1] * (N - k)
        ids = out.output_ids
        assert ids[:k] == reference_greedy(model, p, k) and ids[k:] == reference_greedy(model_v1, p + ids[:k], N - k)
        np.testing.assert_allclose(out.output_logprobs[:k], reference_logprobs(model, p, ids[:k], 0), atol=1e-4)
        np.testing.assert_allclose(out.output_logprobs[k:], reference_logprobs(model_v1, p + ids[:k], ids[k:], 0),
                                   atol=1e-4)


def test_bad_weights_change_no_replica(replicas: ReplicaEngine, ckpt: Path) -> None:
    """A tensor of the wrong shape fails the update before any replica swaps."""
    name = "model.layers.0.mlp.down_proj.weight"

    async def go() -> None:
        with pytest.raises(Exception, match="shape"):
            await replicas.update_weights({name: np.zeros((3, 3), np.float32)}, version=5)

    run(go())
    assert [r.version for r in replicas.replicas] == [0, 0]


def test_bucketed_push_and_handed_over_state_reach_every_replica(replicas: ReplicaEngine, ckpt: Path,
                                                                   ckpt_v1: Path) -> None:
    """v1's tensors staged in two buckets (as an HTTP push sends them) serve on both replicas;
    so does a state handed over from a model on another device (``set_state``, the in-process
    trainer's path), placed onto each replica's own device."""
    from flax import nnx

    from areal_jax.models.hf_io import read_hf_dir

    model_v1 = load_pretrained(ckpt_v1)
    ps = prompts([6, 9], seed=25)
    want = [reference_greedy(model_v1, p, 6) for p in ps]
    tensors = read_hf_dir(ckpt_v1)
    names = sorted(tensors)

    async def answers() -> list[list[int]]:
        outs = await asyncio.gather(*(replicas.generate(GenerateRequest(p, greedy(6))) for p in ps))
        assert {o.weight_version for o in outs} == {replicas.version}
        return [o.output_ids for o in outs]

    async def go() -> tuple:
        await replicas.start()
        try:
            stage = replicas.stage_weights()
            for part in (names[::2], names[1::2]):
                stage.add({n: tensors[n] for n in part})
            assert not stage.missing()
            await replicas.update_weights(stage=stage, version=1)
            staged = await answers()
            await replicas.update_weights(model_dir=str(ckpt), version=2)
            await replicas.set_state(nnx.split(model_v1)[1], version=3)
            handed = await answers()
            return staged, handed, [r.version for r in replicas.replicas]
        finally:
            await replicas.update_weights(model_dir=str(ckpt), version=0)
            await replicas.stop()

    staged, handed, versions = run(go())
    assert staged == want and handed == want and versions == [3, 3]


def test_abort_and_pause_reach_every_replica(replicas: ReplicaEngine) -> None:
    """Answers running on both replicas: one aborted by rid stops on its replica only; a pause in
    place holds both (no token while paused) until resume; abort-all ends the rest on both."""
    ps = prompts([5, 6, 7, 8], seed=24)

    async def go() -> tuple:
        await replicas.start()
        try:
            reqs = [GenerateRequest(p, greedy(60)) for p in ps]
            streams = [replicas.stream(r) for r in reqs]
            firsts = await asyncio.gather(*(anext(s) for s in streams))  # every answer running
            assert sorted(replicas.replica_of(r.rid) for r in reqs) == [0, 0, 1, 1]
            assert await replicas.abort(reqs[0].rid, message="one") == 1
            await replicas.pause("in_place")
            assert all(r.paused == "in_place" for r in replicas.replicas)
            held = replicas.stats["generated_tokens"]
            await asyncio.sleep(0.2)
            paused_tokens = replicas.stats["generated_tokens"] - held
            await replicas.resume()
            n = await replicas.abort(abort_all=True, message="all")
            rests = [joined([f, *[o async for o in s]]) for f, s in zip(firsts, streams, strict=True)]
            return n, paused_tokens, rests
        finally:
            await replicas.stop()

    n, paused_tokens, outs = run(go())
    assert paused_tokens == 0
    assert outs[0].finish_reason == {"type": "abort", "message": "one"}
    assert n == 3 and all(o.finish_reason == {"type": "abort", "message": "all"} for o in outs[1:])
    assert all(len(o.output_ids) < 60 for o in outs)
    assert replicas.num_live == 0
    for r in replicas.replicas:
        assert_no_page_leaked(r)
