"""The ``single_turn`` workflow asks for its group at once (``generate_many``, one batch request
over HTTP) unless told not to, and scores each answer: the trajectories carry each answer's own
tokens, logprobs, versions and reward; an empty answer is dropped."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from areal_jax.controller.workflow import single_turn
from areal_jax.models.tiny import build_char_tokenizer
from rollout_bridge.client import GenerateResult
from tests.controller.fakes import Answer, ScriptedRollout, episode_client, row


@dataclass
class GroupRollout(ScriptedRollout):
    """``ScriptedRollout`` that also answers ``generate_many``, recording each group asked."""

    groups: list[list[list[int]]] = field(default_factory=list)

    async def generate_many(self, prompts: list[list[int]], sampling_params: dict[str, Any] | None = None, *,
                            rids: list[str] | None = None) -> list[GenerateResult]:
        self.groups.append([list(p) for p in prompts])
        return [await self.generate(p, sampling_params) for p in prompts]


ANSWERS = [Answer("19", [-0.5, -0.25, -0.125], [2, 2, 3]), Answer("18", [-1.0, -2.0, -0.5], [3, 3, 3]),
           Answer("", [], [], eos=False), Answer("19", [-0.75, -0.5, -0.25], [3, 3, 3])]


@pytest.mark.parametrize("batch", [True, False])
def test_group_is_asked_at_once_and_each_answer_scored(batch: bool) -> None:
    tok = build_char_tokenizer()
    rollout = GroupRollout(tok, list(ANSWERS))
    client = episode_client(tok, rollout)
    client.group_size, client.batch_groups = 4, batch
    r = row(tok, "12+7=", "19")
    trajs = asyncio.run(single_turn(client, r))

    assert rollout.groups == ([[r.prompt_ids] * 4] if batch else [])
    assert [c[0] for c in rollout.calls] == [r.prompt_ids] * 4
    assert rollout.calls[0][1] == {"temperature": 1.0, "max_new_tokens": 16}
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]  # the empty third answer is dropped
    for t, a in zip(trajs, [ANSWERS[0], ANSWERS[1], ANSWERS[3]], strict=True):
        answer = slice(len(r.prompt_ids), None)
        assert t.input_ids[answer].tolist() == rollout.answer_ids(a)
        assert t.behavior_logprobs[answer].tolist() == a.logprobs and t.versions[answer].tolist() == a.versions
