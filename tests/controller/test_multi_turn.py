"""The ``multi_turn`` workflow driven by a scripted client: a wrong first answer earns the feedback
turn, the right second one a discounted reward; the feedback tokens carry no loss and no policy
version, the answers carry the logprobs and versions rollout reported."""

import asyncio

import numpy as np
import pytest

from areal_jax.controller.workflow import DEFAULT_FEEDBACK, multi_turn
from areal_jax.models import encode_chat
from areal_jax.models.tiny import build_char_tokenizer
from tests.controller.fakes import Answer, ScriptedRollout, episode_client, row


@pytest.mark.parametrize(("options", "reward"), [({}, 0.9), ({"turn_discount": 0.5}, 0.5)])
def test_wrong_then_right_answer_gets_feedback_and_a_discounted_reward(options: dict, reward: float) -> None:
    tok = build_char_tokenizer()
    wrong = Answer("18", [-0.5, -1.5, -0.25], [3, 3, 4])  # the eos token is the third
    right = Answer("19", [-2.0, -0.75, -0.125], [4, 4, 4])
    rollout = ScriptedRollout(tok, [wrong, right])
    r = row(tok, "12+7=", "19")
    [traj] = asyncio.run(multi_turn(episode_client(tok, rollout, **options), r))

    assert len(rollout.calls) == 2
    assert traj.reward == pytest.approx(reward)  # the second turn's reward 1, discounted once
    a1, a2 = rollout.answer_ids(wrong), rollout.answer_ids(right)
    # what the second try was asked: the whole conversation, the feedback rendered by the template
    asked = encode_chat(tok, [*r.messages, {"role": "assistant", "content": "18"},
                              {"role": "user", "content": DEFAULT_FEEDBACK}])
    assert rollout.calls[1][0] == asked
    p, n1 = len(r.prompt_ids), len(a1)
    env = asked[p + n1:]
    assert DEFAULT_FEEDBACK in tok.decode(env)
    assert rollout.calls[0][0] == r.prompt_ids and asked[:p + n1] == r.prompt_ids + a1
    assert traj.input_ids.tolist() == asked + a2 and traj.prompt_len == p

    pieces = [("prompt", p), ("answer 1", n1), ("feedback", len(env)), ("answer 2", len(a2))]
    at = np.cumsum([0] + [n for _, n in pieces])
    part = {name: slice(at[i], at[i + 1]) for i, (name, _) in enumerate(pieces)}
    assert traj.loss_mask[part["feedback"]].tolist() == [0.0] * len(env)
    assert traj.versions[part["feedback"]].tolist() == [-1] * len(env)
    assert traj.behavior_logprobs[part["feedback"]].tolist() == [0.0] * len(env)
    assert traj.loss_mask[part["prompt"]].tolist() == [0.0] * p
    for name, answer in (("answer 1", wrong), ("answer 2", right)):
        assert traj.loss_mask[part[name]].tolist() == [1.0] * len(answer.versions), name
        assert traj.versions[part[name]].tolist() == answer.versions, name
        assert traj.behavior_logprobs[part[name]].tolist() == answer.logprobs, name


def test_right_first_answer_is_not_discounted_and_asks_once() -> None:
    tok = build_char_tokenizer()
    rollout = ScriptedRollout(tok, [Answer("19", [-1.0, -1.0, -1.0], [0, 0, 0])])
    [traj] = asyncio.run(multi_turn(episode_client(tok, rollout), row(tok, "12+7=", "19")))
    assert len(rollout.calls) == 1 and traj.reward == 1.0
