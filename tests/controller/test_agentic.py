"""The ``agentic`` workflow makes one trajectory per agent run, whatever the number of calls
(AReaL's ``concat`` export): runs of 1+2 and 1+1 calls gave groups of 3 and 2 trajectories,
which GRPO refused ("groups must all have the same size"). The concatenation holds the model's
tokens with their logprobs and versions, trained, and the environment's tokens between them
(tool results, turn markers), masked. ``per_turn`` keeps a trajectory per completion with the
run's reward discounted backwards per turn."""

import asyncio

import numpy as np
import pytest

from areal_jax.algo.advantages import grpo_advantages
from areal_jax.controller.workflow import agentic
from areal_jax.models.tiny import build_char_tokenizer
from tests.controller.fakes import Answer, ScriptedRollout, episode_client, row

RUNS = {"calls": []}


async def tool_agent(chat, row):
    """The first run makes three calls (1+2), the second two (1+1); a tool result after each
    call but the last. The reward: whether the last answer is the row's answer."""
    calls = 3 if not RUNS["calls"] else 2
    RUNS["calls"].append(calls)
    messages = list(row.messages)
    for k in range(calls):
        reply = await chat.completions.create(messages=messages)
        messages.append(reply.choices[0].message.to_dict())
        if k < calls - 1:
            messages.append({"role": "user", "content": f"tool says {k}"})
    return 1.0 if reply.choices[0].message.content == row.reward_fields["answer"] else 0.0


def _answers() -> list[Answer]:
    text = ["7+", "12", "19", "18", "19"]
    return [Answer(t, [-0.5 - i / 8, -0.25, -0.125], [i, i + 1, i + 1]) for i, t in enumerate(text)]


def test_each_run_is_one_concatenated_trajectory_and_groups_are_even() -> None:
    RUNS["calls"].clear()
    tok = build_char_tokenizer()
    answers = _answers()
    rollout = ScriptedRollout(tok, answers)
    client = episode_client(tok, rollout, agent="tests.controller.test_agentic:tool_agent")
    client.group_size = 2
    r = row(tok, "12+7=", "19")
    trajs = asyncio.run(agentic(client, r))

    assert RUNS["calls"] == [3, 2] and len(rollout.calls) == 5
    assert len(trajs) == 2  # one per run: a group of group_size
    assert [t.reward for t in trajs] == [1.0, 1.0]
    for t, calls in zip(trajs, [rollout.calls[:3], rollout.calls[3:]], strict=True):
        last_prompt = calls[-1][0]
        mine = [answers[i] for i, c in enumerate(rollout.calls) if any(c is x for x in calls)]
        # the sequence is the last call's prompt followed by its answer
        assert t.input_ids.tolist() == last_prompt + rollout.answer_ids(mine[-1])
        assert t.prompt_len == len(calls[0][0]) == len(r.prompt_ids)
        # trained: exactly the generated tokens, at the places they were generated
        pos = 0
        expect_mask = np.zeros(len(t.input_ids))
        expect_lp = np.zeros(len(t.input_ids))
        expect_v = np.full(len(t.input_ids), -1)
        for (asked, _), a in zip(calls, mine, strict=True):
            assert t.input_ids[:len(asked)].tolist() == asked  # each call's prompt is a prefix of the run
            pos = len(asked)
            n = len(rollout.answer_ids(a))
            expect_mask[pos:pos + n], expect_lp[pos:pos + n], expect_v[pos:pos + n] = 1, a.logprobs, a.versions
        assert t.loss_mask.tolist() == expect_mask.tolist()
        np.testing.assert_array_equal(t.behavior_logprobs, expect_lp.astype(np.float32))
        assert t.versions.tolist() == expect_v.tolist()
        # the environment's tokens (the tool results) are in the sequence and carry no loss
        env = tok.decode(t.input_ids[t.loss_mask == 0].tolist())
        assert "tool says 0" in env
    assert "tool says 1" in tok.decode(trajs[0].input_ids.tolist())
    # the estimator GRPO uses takes the group as it is
    adv = grpo_advantages(np.array([t.reward for t in trajs], np.float32), group_size=2)
    assert np.asarray(adv).shape == (2,)


def test_per_turn_discounts_the_run_reward_backwards() -> None:
    RUNS["calls"].clear()
    tok = build_char_tokenizer()
    rollout = ScriptedRollout(tok, _answers()[:3])
    client = episode_client(tok, rollout, agent="tests.controller.test_agentic:tool_agent", trajectory="per_turn",
                            turn_discount=0.5)
    trajs = asyncio.run(agentic(client, row(tok, "12+7=", "19")))
    assert [t.reward for t in trajs] == [0.25, 0.5, 1.0]
    assert [t.run_id for t in trajs] == [0, 0, 0]  # one run: its turns share the run's id
    assert [t.input_ids.tolist() for t in trajs] == [c[0] + rollout.answer_ids(a)
                                                     for c, a in zip(rollout.calls, _answers(), strict=False)]


def test_a_run_that_rewrites_its_history_is_named() -> None:
    async def rewriter(chat, row):
        await chat.completions.create(messages=row.messages)
        await chat.completions.create(messages=[{"role": "user", "content": "something else entirely"}])
        return 1.0

    import tests.controller.test_agentic as me

    me.rewriter = rewriter
    tok = build_char_tokenizer()
    rollout = ScriptedRollout(tok, _answers()[:2])
    client = episode_client(tok, rollout, agent="tests.controller.test_agentic:rewriter")
    with pytest.raises(ValueError, match="call 2: its messages do not continue the run.*trajectory=per_turn"):
        asyncio.run(agentic(client, row(tok, "12+7=", "19")))


@pytest.mark.parametrize("stats", ["run", "turn"])
def test_per_turn_runs_of_uneven_length_train_under_grpo(stats) -> None:
    """Runs of 3 and 2 calls leave 5 per-turn trajectories, a group GRPO refused before. With
    ``group_stats: run`` each turn carries its run's id and discount and GRPO normalises over the
    two runs: both earned 1, so every turn scores 0 (a turn count would see rewards 0.25, 0.5,
    1, 0.5, 1 and score the earlier turns of these winning runs negative). ``turn`` makes each
    turn a member of its own with its discounted reward."""
    from areal_jax.algo import AlgoConfig, compute_advantages
    from areal_jax.algo.advantages import dense_run_ids

    RUNS["calls"].clear()
    tok = build_char_tokenizer()
    client = episode_client(tok, ScriptedRollout(tok, _answers()), agent="tests.controller.test_agentic:tool_agent",
                            trajectory="per_turn", turn_discount=0.5, group_stats=stats)
    client.group_size = 2
    trajs = asyncio.run(agentic(client, row(tok, "12+7=", "19")))
    rew = np.array([0.25, 0.5, 1.0, 0.5, 1.0])
    assert [t.reward for t in trajs] == rew.tolist()
    assert [t.run_id for t in trajs] == ([0, 0, 0, 1, 1] if stats == "run" else [0, 1, 2, 3, 4])
    assert [t.discount for t in trajs] == (rew.tolist() if stats == "run" else [1.0] * 5)
    g, r = dense_run_ids([0] * 5, [t.run_id for t in trajs])
    width = max(len(t) for t in trajs)
    mask = np.stack([np.pad(t.loss_mask, (0, width - len(t))) for t in trajs])
    adv, _ = compute_advantages(AlgoConfig(), rew.astype(np.float32), mask, group_ids=np.array(g),
                                run_ids=np.array(r), discounts=np.array([t.discount for t in trajs], np.float32))
    last = np.asarray(adv)[np.arange(5), [int(np.flatnonzero(m)[-1]) for m in mask]]
    expect = np.zeros(5) if stats == "run" else (rew - rew.mean()) / (rew.std(ddof=1) + 1e-5)
    np.testing.assert_allclose(last, expect, rtol=1e-5, atol=1e-5)
