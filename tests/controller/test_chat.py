"""``RecordingChat``, the openai-shaped client of agentic workflows, against a scripted rollout
client: ``tools=`` reach the chat template, a ``<tool_call>`` in the answer comes back as
``tool_calls`` with ``finish_reason="tool_calls"``, and the exported trajectories hold exactly
the tokens, logprobs and policy versions rollout produced."""

import asyncio
import json

import pytest

from areal_jax.controller.chat import RecordingChat
from areal_jax.models.tiny import CHAT_TEMPLATE, build_char_tokenizer
from tests.controller.fakes import Answer, ScriptedRollout, episode_client

# ChatML with the tools' names in a system turn, as Qwen's templates list them.
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t['function']['name'] }};"
                  "{% endfor %}</tools><|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_tool_call_round_trip_and_the_exported_trajectories() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    call = Answer(CALL, [-0.5] * (len(CALL) + 1), [2] * 10 + [3] * (len(CALL) - 9))  # a weight update mid-answer
    final = Answer("sunny", [-0.25, -1.0, -2.0, -0.125, -0.5, -0.75], [3] * 6)
    rollout = ScriptedRollout(tok, [call, final])
    chat = RecordingChat(episode_client(tok, rollout))
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    async def agent() -> tuple:
        first = await chat.chat.completions.create(messages=messages, tools=[WEATHER], temperature=0.5, max_tokens=64)
        msg = first.choices[0].message
        second = await chat.completions.create(messages=[*messages, msg, {"role": "tool", "content": "sunny, 21C"}],
                                               tools=[WEATHER])
        return first, second

    first, second = asyncio.run(agent())

    # the tools were rendered into the prompt by the template
    asked_first = tok.decode(rollout.calls[0][0])
    assert asked_first.startswith("<|im_start|>system\n<tools>get_weather;</tools>")
    assert rollout.calls[0][1]["temperature"] == 0.5 and rollout.calls[0][1]["max_new_tokens"] == 64
    # the tool call, parsed
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Paris"}
    assert choice.message.content == ""  # the call's markup is not left in the content
    # the assistant turn and the tool's reply went back into the second prompt
    assert "sunny, 21C" in tok.decode(rollout.calls[1][0])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content == "sunny"
    assert first.usage.completion_tokens == len(call.versions)

    chat.set_reward(first.id, 0.25)
    trajs = chat.export(reward=1.0)
    assert [t.reward for t in trajs] == [0.25, 1.0]
    for t, (asked, _), answer in zip(trajs, rollout.calls, [call, final], strict=True):
        n = len(asked)
        assert t.input_ids.tolist() == asked + rollout.answer_ids(answer) and t.prompt_len == n
        assert t.loss_mask.tolist() == [0.0] * n + [1.0] * len(answer.versions)
        assert t.behavior_logprobs[n:].tolist() == answer.logprobs
        assert t.versions.tolist() == [-1] * n + answer.versions


def test_no_tools_no_tools_section_and_a_reward_is_required() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    rollout = ScriptedRollout(tok, [Answer("hi", [-1.0, -1.0], [0, 0], finish="length", eos=False)])
    chat = RecordingChat(episode_client(tok, rollout))
    out = asyncio.run(chat.completions.create(messages=[{"role": "user", "content": "hello"}]))
    assert "<tools>" not in tok.decode(rollout.calls[0][0])
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError, match="has no reward"):
        chat.export()
