"""A custom workflow and an openai-SDK-style agent, named by import path in the RL loop tests."""

from areal_jax.controller.workflow import single_turn

CALLS = {"episodes": 0}


async def tagged_episode(client, row):
    """A user's workflow: the built-in single turn, then a reward of its own (answer length)."""
    trajectories = await single_turn(client, row)
    for t in trajectories:
        t.reward = float(t.answer_len)  # varies within a group, so advantages are nonzero
    return trajectories


async def calculator_agent(chat, row):
    """Agent code written against the openai SDK's shape: two chat turns, the second seeing the first."""
    messages = list(row.messages)
    first = await chat.chat.completions.create(messages=messages, max_tokens=4, temperature=1.0)
    messages.append(first.choices[0].message.to_dict())
    messages.append({"role": "user", "content": "Check it once more."})
    second = await chat.completions.create(messages=messages, max_tokens=4)
    assert first.usage.completion_tokens >= 1 and second.object == "chat.completion"
    chat.set_reward(first.id, 0.5)
    return 1.0 if second.choices[0].message.content.strip() == str(row.reward_fields["entry"]["answer"]) else 0.0


async def nan_reward_episode(client, row):
    """A reward function gone wrong: every answer scores NaN, so every update is non-finite."""
    trajectories = await single_turn(client, row)
    for t in trajectories:
        t.reward = float("nan")
    return trajectories
