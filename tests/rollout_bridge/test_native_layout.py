"""Kernels in our own layout between our trainer and our servers: the stream, the staging and
the bucket protocol agree on which layout a transfer is in, and refuse a mix."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import jax
import numpy as np
from flax import nnx

from areal_jax.models import assign_hf_tensors, hf_tensor_specs, iter_hf_tensors, load_pretrained
from areal_jax.models.safetensors_codec import encode_tensor_bucket
from rollout_bridge.state import STATE
from tests.rollout_bridge.test_hardening import TIMEOUT, _server


def test_native_stream_round_trips_and_differs_from_hf(tiny_dir: Path) -> None:
    src = load_pretrained(tiny_dir)
    nnx.update(src, jax.tree.map(lambda x: x * 1.3, nnx.state(src, nnx.Param)))
    hf, native = iter_hf_tensors(src), iter_hf_tensors(src, hf_layout=False)
    assert hf.hf_layout and not native.hf_layout
    assert [n for n, _, _ in hf.layout] == [n for n, _, _ in native.layout]
    hf_t, native_t = dict(hf), dict(native)
    transposed = [n for n in hf_t if hf_t[n].ndim == 2 and n.endswith("proj.weight")]
    assert transposed and all(np.array_equal(native_t[n], hf_t[n].T) for n in transposed)
    assert any(native_t[n].shape != hf_t[n].shape for n in transposed)  # some kernel is not square
    assert hf_tensor_specs(src, hf_layout=False) == {n: a.shape for n, a in native_t.items()}

    dst = load_pretrained(tiny_dir)
    assign_hf_tensors(dst, native_t, hf_layout=False)
    for a, b in zip(jax.tree.leaves(nnx.state(src, nnx.Param)), jax.tree.leaves(nnx.state(dst, nnx.Param)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_server_refuses_a_bucket_in_the_other_layout(tiny_dir: Path) -> None:
    model = load_pretrained(tiny_dir)
    hf, native = dict(iter_hf_tensors(model)), dict(iter_hf_tensors(model, hf_layout=False))
    odd = next(n for n in hf if hf[n].shape != native[n].shape)
    other = next(n for n in hf if n != odd)

    async def main() -> None:
        async with _server(tiny_dir) as (url, app), aiohttp.ClientSession(timeout=TIMEOUT) as s:
            st = app[STATE]

            async def bucket(tid: str, i: int, tensors: dict, layout: str | None) -> tuple[int, str]:
                q = {"weight_version": "v2", "transfer_id": tid, "bucket": str(i), "last": "false"}
                if layout is not None:
                    q["layout"] = layout
                async with s.post(url + "/update_weights_from_tensor", params=q,
                                  headers={"Content-Type": "application/octet-stream"},
                                  data=encode_tensor_bucket(tensors)) as r:
                    return r.status, await r.text()

            # our layout sent without saying so: the shapes are checked as HF ones
            status, text = await bucket("a", 0, {odd: native[odd]}, None)
            assert status == 400 and odd in text and st.staged is None
            # said: staged; then a bucket of the same transfer in the other layout drops it
            assert (await bucket("b", 0, {odd: native[odd]}, "native"))[0] == 200
            assert st.staged is not None and st.staged.stage.hf_layout is False
            status, text = await bucket("b", 1, {other: hf[other]}, "hf")
            assert status == 400 and "layout" in text and st.staged is None
            status, text = await bucket("c", 0, {odd: native[odd]}, "sideways")
            assert status == 400 and "layout" in text
            assert st.engine.version == 0

    asyncio.run(main())
