"""One host's engine of a pod run (``rollout_bridge/hosts.py``), in one process: weights staged
in this process while the engine serves are held until ``/commit_weights``, then served under
their label; a stage that fails holds nothing and the commit is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from areal_jax.models import iter_hf_tensors, load_pretrained
from rollout_bridge.client import HttpRolloutClient, WeightUpdateError
from rollout_bridge.hosts import EngineHost, reachable_address
from rollout_bridge.local import build_engine
from rollout_bridge.state import STATE

PROMPT = [1, 2, 3, 4]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_a_held_version_serves_from_its_commit_on_and_a_failed_stage_holds_nothing(tiny_dir: Path) -> None:
    new = load_pretrained(tiny_dir)
    nnx.update(new, jax.tree.map(lambda x: x * 1.5, nnx.state(new, nnx.Param)))

    async def main() -> None:
        engine = build_engine(tiny_dir, ["--max-running-requests", "4", "--context-length", "64"], seed=0,
                              fuse_projections=True)
        host = EngineHost(engine, model_path=tiny_dir)
        url = await host.start("127.0.0.1")
        try:
            async with HttpRolloutClient([url]) as client:
                before = await client.generate(PROMPT, GREEDY)
                # Staged from another thread while the engine serves: nothing changes until the commit.
                assert await asyncio.to_thread(host.hold, iter_hf_tensors(new, hf_layout=False), "v1", "1") is None
                held = await client.generate(PROMPT, GREEDY)
                assert held.output_versions == [0] * 6 and held.output_logprobs == before.output_logprobs
                await client.commit_weights(1, "v1")
                after = await client.generate(PROMPT, GREEDY)
                assert after.output_versions == [1] * 6
                assert not np.allclose(after.output_logprobs, before.output_logprobs, atol=1e-3)

                # A tensor of the wrong shape: the rest is still taken (the gathers are collective),
                # nothing is held, the commit is refused and version 1 keeps serving.
                bad = [(n, a[:1] if i == 3 else a) for i, (n, a) in enumerate(iter_hf_tensors(new, hf_layout=False))]
                taken = []
                error = await asyncio.to_thread(host.hold, (taken.append(t) or t for t in bad), "v2", "2")
                assert error is not None and bad[3][0] in error and len(taken) == len(bad)
                assert host.app[STATE].held is None
                with pytest.raises(WeightUpdateError, match="no held transfer"):
                    await client.commit_weights(2, "v2")
                again = await client.generate(PROMPT, GREEDY)
                assert again.output_versions == [1] * 6 and again.output_ids == after.output_ids
        finally:
            await host.stop()
        assert host.served() == {"default": 12, "1": 12}

    asyncio.run(main())


def test_reachable_address_is_the_local_end_of_the_route_to_the_peer() -> None:
    assert reachable_address("127.0.0.1") == "127.0.0.1"
