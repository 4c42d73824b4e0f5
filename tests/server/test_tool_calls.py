"""Function calling: the hermes parser (whole and streamed, against each other on random answers), and tools on
/v1/chat/completions through the openai client: auto (the random model's answer held to a tool call by a
constraint), a named function, "required", tool results in the conversation; bad tool requests are 400s."""
from __future__ import annotations

import json
import random

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from pellucid.server.protocol import ProtocolError
from pellucid.server.tool_calls import plan_tools
from pellucid.server.tool_parsers import HermesToolCallParser
from server_harness import MODEL_NAME

# Small definitions: the tiny model's template spells them out in a 512-token context.
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}, "exact": {"type": "boolean"}}}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]


def _random_answer(rng: random.Random) -> tuple[str, str | None, list[tuple[str, dict]]]:
    """An answer with some text, then 0-3 calls (the last maybe unclosed); its content and calls."""
    text = rng.choice(["", "Let me check. ", "sure<tool", "a < b "])
    calls = [(rng.choice(["get_weather", "get_time"]), {"city": rng.choice(["Paris", "Rome"]), "n": rng.randrange(9)})
             for _ in range(rng.randrange(4))]
    answer = text
    for i, (name, arguments) in enumerate(calls):
        body = json.dumps({"name": name, "arguments": arguments})
        closed = i < len(calls) - 1 or rng.random() < 0.7
        answer += "<tool_call>\n" + body + ("\n</tool_call>" if closed else "\n")
    return answer, (text or None) if calls else text, calls


@pytest.mark.parametrize("seed", range(6))
def test_hermes_parser_whole_and_streamed_agree(seed):
    rng = random.Random(seed)
    for _ in range(20):
        answer, content, calls = _random_answer(rng)
        parsed = HermesToolCallParser().parse(answer)
        assert parsed.content == content
        assert [(n, json.loads(a)) for n, a in parsed.calls] == calls
        stream, sent, streamed = HermesToolCallParser(), "", []
        cut = 0
        while cut < len(answer):
            cut = min(len(answer), cut + rng.randrange(1, 6))
            piece, new_calls = stream.stream(answer[:cut], finished=cut == len(answer))
            sent += piece
            streamed += new_calls
            assert answer.startswith(sent) and len(sent) <= cut    # content comes in order, never ahead
        assert (sent or None) == (content if calls else (answer or None))
        assert streamed == parsed.calls


def test_hermes_parser_keeps_malformed_calls_as_text():
    answer = 'hi <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HermesToolCallParser().parse(answer).content == answer and not HermesToolCallParser().parse(answer).calls
    stream = HermesToolCallParser()
    content, calls = stream.stream(answer, finished=True)
    assert content == answer and calls == []
    held, _ = HermesToolCallParser().stream("text <tool_ca", finished=False)
    assert held == "text "       # a partial tag waits for the next token


def test_tool_plans_refuse_what_cannot_be_served():
    with pytest.raises(ProtocolError, match="enable-auto-tool-choice"):
        plan_tools(TOOLS, "auto", HermesToolCallParser, auto_enabled=False)
    for tools, choice, param in ((TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([{"type": "function"}], "required", "tools.0"),
                                 (None, "required", "tool_choice"), (TOOLS, "sometimes", "tool_choice")):
        with pytest.raises(ProtocolError) as refused:
            plan_tools(tools, choice, HermesToolCallParser, auto_enabled=True)
        assert refused.value.param == param
    assert plan_tools(None, "none", None, auto_enabled=False) is None


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def no_blank(server_model_dir) -> dict[str, float]:
    """A logit bias against every whitespace-only token: a random model would otherwise fill the JSON
    grammars' optional blanks until max_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    return {str(t): -100 for t in range(len(tokenizer)) if not tokenizer.decode([t]).strip()}


def _streamed(client, **kwargs):
    """(content, tool calls as {index: [id, name, arguments]}, finish reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, [None, None, ""])
                entry[0] = entry[0] or call.id
                entry[1] = entry[1] or call.function.name
                entry[2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_finds_the_calls_in_the_answer(client, stream):
    """The answer is held to a text with two hermes calls by a choice constraint (a random model would not
    write one); the parser returns its content and calls, finish reason tool_calls."""
    answer = ('Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"choice": [answer]}})
    expected = [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    if stream:
        content, calls, finish = _streamed(client, **kwargs)
        assert content == "Checking. " and finish == "tool_calls"
        assert [(name, json.loads(arguments)) for _, name, arguments in calls.values()] == expected
        assert all(call_id.startswith("chatcmpl-tool-") for call_id, _, _ in calls.values())
        return
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.message.content == "Checking. " and reply.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == expected
    single = client.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in single.message.tool_calls] == expected[:1]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=5,
                                           temperature=0)
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_give_valid_calls(client, no_blank, stream):
    named = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0.8, seed=2,
                 tool_choice={"type": "function", "function": {"name": "get_time"}}, logit_bias=no_blank)
    # One call (a random model would otherwise add calls to the array until max_tokens).
    required = dict(named, tool_choice="required", max_tokens=150, seed=5, parallel_tool_calls=False)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for kwargs, finish_expected in ((named, "stop"), (required, "tool_calls")):
        if stream:
            content, streamed, finish = _streamed(client, **kwargs)
            calls = [(name, arguments) for _, name, arguments in streamed.values()]
            assert not content
        else:
            reply = client.chat.completions.create(**kwargs).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
            finish = reply.finish_reason
            assert not reply.message.content
        assert finish == finish_expected and calls
        assert [name for name, _ in calls] == ["get_time"] if kwargs is named else len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_tools_and_tool_results_reach_the_chat_template(client, server_model_dir):
    """The prompt counts the tools and a past call with its result as the tokenizer's template renders them
    (the call's arguments given as JSON text, which templates get as an object)."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=2, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    rendered = [dict(m) for m in messages]
    rendered[1]["tool_calls"] = [dict(rendered[1]["tool_calls"][0], function={"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}})]
    expected = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "get_time" in expected and '{"city": "Paris"}' in expected and "sunny" in expected
    assert reply.usage.prompt_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert reply.choices[0].message.tool_calls == []


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(server, body, param):
    response = httpx.post(f"{server.base_url}/chat/completions", timeout=30,
                          json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
