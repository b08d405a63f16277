"""A follower's share of a batch (``trainer/multihost.py``), encoded and decoded in one process:
its own trajectories arrive whole, the others as placeholders with their real lengths, loss
masks and scalars and NaN logprobs; only its own tokens are in its blob."""

from __future__ import annotations

import numpy as np
import pytest

from areal_jax.trainer.multihost import decode_share, encode, encode_shares, local_share
from tests.trainer.helpers import random_trajectories


@pytest.mark.parametrize("fractional_mask", [False, True])
def test_each_process_gets_its_own_tokens_and_everyone_s_masks(fractional_mask: bool) -> None:
    trajs = random_trajectories(np.random.default_rng(0), 3, 4)
    if fractional_mask:  # a mask that is not 0/1 travels as float32, not as bits
        trajs[5].loss_mask = trajs[5].loss_mask * 0.5
    trajs[2].truncated, trajs[7].run_id, trajs[7].discount = True, 3, 0.25
    shares = [set(range(12)), {1, 5, 6}, set()]
    header, blobs = encode_shares({"op": "train", "step": 4, "version": 2, "trajectories": trajs}, shares)
    assert blobs[0] and not blobs[2]
    assert len(blobs[1]) == 12 * sum(len(trajs[i]) for i in (1, 5, 6))  # int32 ids, float32 logprobs, int32 versions
    for p, share in enumerate(shares):
        got = decode_share(header, blobs[p], p)
        assert (got["op"], got["step"], got["version"], got["own"]) == ("train", 4, 2, len(share))
        assert got["whole_token_bytes"] == 16 * sum(len(t) for t in trajs)
        for i, (t, want) in enumerate(zip(got["trajectories"], trajs, strict=True)):
            np.testing.assert_array_equal(t.loss_mask, want.loss_mask)
            assert (t.reward, t.group_id, t.prompt_len, t.truncated, t.run_id, t.discount) == (
                want.reward, want.group_id, want.prompt_len, want.truncated, want.run_id, want.discount)
            if i in share:
                np.testing.assert_array_equal(t.input_ids, want.input_ids)
                np.testing.assert_array_equal(t.behavior_logprobs, want.behavior_logprobs)
                np.testing.assert_array_equal(t.versions, want.versions)
            else:
                assert len(t) == len(want) and np.isnan(t.behavior_logprobs).all() and not t.input_ids.any()
    # The header is lengths, scalars and one bit a token of mask: far below the whole message.
    whole = len(encode({"op": "train", "trajectories": trajs}))
    assert len(header) < whole / 2 if not fractional_mask else len(header) < whole


def test_local_share_is_what_a_follower_decodes() -> None:
    trajs = random_trajectories(np.random.default_rng(1), 2, 4)
    header, blobs = encode_shares({"op": "train", "trajectories": trajs}, [set(range(8)), {0, 3}])
    decoded = decode_share(header, blobs[1], 1)["trajectories"]
    for a, b in zip(local_share(trajs, {0, 3}), decoded, strict=True):
        for name in ("input_ids", "loss_mask", "behavior_logprobs", "versions"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
