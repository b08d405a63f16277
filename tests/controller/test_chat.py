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


# --- the SDK's own types, and what agents commonly pass (issue 43) ------------------------------

def test_responses_are_the_sdks_types() -> None:
    from openai.types.chat import ChatCompletion

    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    rollout = ScriptedRollout(tok, [Answer(CALL, [-0.5] * (len(CALL) + 1), [0] * (len(CALL) + 1))])
    chat = RecordingChat(episode_client(tok, rollout))
    out = asyncio.run(chat.completions.create(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                              tool_choice="auto", user="me", parallel_tool_calls=True))
    assert isinstance(out, ChatCompletion)
    dumped = out.model_dump()
    assert ChatCompletion.model_validate(dumped) == out
    call = dumped["choices"][0]["message"]["tool_calls"][0]
    assert call["type"] == "function" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out.choices[0].message.to_dict()["role"] == "assistant"


# Renders the assistant's tool calls as a Qwen template does: the arguments through ``tojson``.
CALLS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['arguments'] | tojson }}"
                  "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_sdk_messages_go_back_into_the_template_with_arguments_as_a_mapping() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = CALLS_TEMPLATE
    rollout = ScriptedRollout(tok, [Answer(CALL, [-0.5] * (len(CALL) + 1), [0] * (len(CALL) + 1)),
                                    Answer("ok", [-1.0] * 3, [0] * 3)])
    chat = RecordingChat(episode_client(tok, rollout), tool_parser="hermes")

    async def agent() -> None:
        first = await chat.completions.create(messages=[{"role": "user", "content": "w?"}], tools=[WEATHER])
        await chat.completions.create(messages=[{"role": "user", "content": "w?"}, first.choices[0].message,
                                                {"role": "tool", "content": "sunny"}], tools=[WEATHER])

    asyncio.run(agent())
    asked = tok.decode(rollout.calls[1][0])
    assert '<tool_call>{"city": "Paris"}</tool_call>' in asked  # not a JSON string quoted again


def test_stop_strings_cut_the_answer_and_one_token_stops_go_to_the_server() -> None:
    tok = build_char_tokenizer()
    text = "19 and then more"
    n = len(text) + 1
    rollout = ScriptedRollout(tok, [Answer(text, [-0.5] * n, list(range(n)), finish="length"),
                                    Answer(text, [-0.5] * n, list(range(n)))])
    chat = RecordingChat(episode_client(tok, rollout))
    out = asyncio.run(chat.completions.create(messages=[{"role": "user", "content": "q"}], stop=[" and", "zz"]))
    assert out.choices[0].message.content == "19" and out.choices[0].finish_reason == "stop"
    [t] = chat.export(reward=1.0)
    kept = len(tok.encode("19 and", add_special_tokens=False))  # up to the token that completes the stop
    assert t.answer_len == kept and t.versions[-kept:].tolist() == list(range(kept))
    asyncio.run(chat.completions.create(messages=[{"role": "user", "content": "q"}], stop="!"))
    assert rollout.calls[1][1]["stop_token_ids"] == tok.encode("!", add_special_tokens=False)


def test_n_answers_and_the_run_goes_on_with_the_continued_one() -> None:
    tok = build_char_tokenizer()
    answers = [Answer("a", [-0.5] * 2, [0] * 2), Answer("b", [-0.25] * 2, [0] * 2), Answer("c", [-1.0] * 2, [1] * 2)]
    rollout = ScriptedRollout(tok, answers)
    chat = RecordingChat(episode_client(tok, rollout))

    async def agent() -> None:
        first = await chat.completions.create(messages=[{"role": "user", "content": "q"}], n=2)
        assert [c.message.content for c in first.choices] == ["a", "b"] and first.usage.completion_tokens == 4
        await chat.completions.create(messages=[{"role": "user", "content": "q"}, first.choices[1].message,
                                                {"role": "user", "content": "more"}])

    asyncio.run(agent())
    t = chat.export_concat(reward=1.0)
    assert tok.decode(t.input_ids[t.loss_mask > 0].tolist(), skip_special_tokens=True) == "bc"
    assert len(chat.export(reward=1.0)) == 3  # per turn: every answer


def test_tool_choice_and_response_format() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    rollout = ScriptedRollout(tok, [Answer(CALL, [-0.5] * (len(CALL) + 1), [0] * (len(CALL) + 1))])
    chat = RecordingChat(episode_client(tok, rollout))
    out = asyncio.run(chat.completions.create(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                                              tool_choice="none", response_format={"type": "json_object"}))
    assert "<tools>" not in tok.decode(rollout.calls[0][0])  # none: the tools are not offered
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content == CALL
    with pytest.raises(ValueError, match="tool_choice='required' would force a tool call"):
        asyncio.run(chat.completions.create(messages=[], tools=[WEATHER], tool_choice="required"))
    with pytest.raises(ValueError, match="stream=True is not supported"):
        asyncio.run(chat.completions.create(messages=[], stream=True))
    with pytest.raises(ValueError, match=r"unsupported arguments \['frobnicate'\]"):
        asyncio.run(chat.completions.create(messages=[], frobnicate=1))


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", 'Let me check.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>{bad}'
               '</tool_call>', "Let me check. <tool_call>{bad}</tool_call>", [("f", {"x": 1})]),
    ("hermes", "no call here", "no call here", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} and then prose', None, None),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
])
def test_tool_call_parsers_per_model_family(parser: str, text: str, content: str | None, calls: list | None) -> None:
    from areal_jax.controller.chat import PARSERS

    got_content, got_calls = PARSERS[parser](text)
    if calls is None:  # not a well-formed call: all of it stays content
        assert got_content == text and got_calls == []
        return
    assert got_content == content and [(c["name"], c["arguments"]) for c in got_calls] == calls


def test_the_parser_follows_the_chat_template() -> None:
    from areal_jax.controller.chat import detect_tool_parser

    llama = ("{{- '<|start_header_id|>' }}Respond in the format {\"name\": function name, \"parameters\": dictionary}"
             "{{ '<|python_tag|>' }}<|eot_id|>")
    assert detect_tool_parser(llama) == "llama3_json"
    assert detect_tool_parser(TOOLS_TEMPLATE.replace("<tools>", "<tool_call>")) == "hermes"
    assert detect_tool_parser(None) == "hermes"


def test_an_agent_runs_turns_name_one_session_and_two_runs_two() -> None:
    """Each ``RecordingChat`` (one agent run) names its own session on every request, so a
    client over several servers keeps a run's turns on one (tests/rollout_bridge/test_sessions.py);
    a rollout client whose ``generate`` takes no ``session`` is called without one (the other
    tests here)."""
    tok = build_char_tokenizer()
    seen: list[str | None] = []

    class SessionRollout(ScriptedRollout):
        async def generate(self, input_ids, sampling_params=None, *, rid=None, session=None):  # noqa: ANN001, ANN202
            seen.append(session)
            return await super().generate(input_ids, sampling_params, rid=rid)

    rollout = SessionRollout(tok, [Answer("a", [-0.5, -0.5], [1, 1])] * 4)
    runs = [RecordingChat(episode_client(tok, rollout)) for _ in range(2)]

    async def two_turns(chat: RecordingChat) -> None:
        for _ in range(2):
            await chat.completions.create(messages=[{"role": "user", "content": "hi"}])

    asyncio.run(two_turns(runs[0]))
    asyncio.run(two_turns(runs[1]))
    s = seen
    assert len(s) == 4 and s[0] == s[1] and s[2] == s[3] and s[0] != s[2] and all(s)
