"""The mistral, llama3_json and pythonic tool-call parsers: random answers written in each format give back
their calls and content, whole and streamed in random pieces alike; malformed calls stay text; and each
parser serves tool_choice "auto" through the openai client."""
from __future__ import annotations

import json
import random

import openai
import pytest

from pellucid.server.app import build_app
from pellucid.server.tool_parsers import TOOL_CALL_PARSERS
from server_harness import MODEL_NAME, run_app_in_thread

NAMES = ["get_weather", "get_time", "lookup"]


def _arguments(rng: random.Random) -> dict:
    pool = {"city": rng.choice(["Paris", "Rome", 'Q"uote']), "n": rng.randrange(-5, 99), "flag": rng.random() < 0.5,
            "items": [rng.randrange(9) for _ in range(rng.randrange(3))], "nested": {"k": None}, "x": 1.5}
    return {key: pool[key] for key in rng.sample(sorted(pool), rng.randrange(len(pool) + 1))}


def _python_literal(value) -> str:
    return repr(value)      # dicts, lists, strings, numbers, True / False / None: Python's own spelling


def write_answer(parser: str, rng: random.Random) -> tuple[str, str | None, list[tuple[str, dict]]]:
    """(an answer in the parser's format with 0-3 calls, its content, its calls)."""
    calls = [(rng.choice(NAMES), _arguments(rng)) for _ in range(rng.randrange(4))]
    text = rng.choice(["", "Let me check. ", "[note] ", "{x} ", "a [TOOL"]) if parser == "mistral" or not calls else ""
    if not calls:
        text = rng.choice(["plain words", "[1] a list-like start", "{not json", "  spaced", ""])
        return text, text, []
    if parser == "mistral":
        if rng.random() < 0.5:
            body = "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
        else:
            body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
        return text + body, text or None, calls
    if parser == "llama3_json":
        key = rng.choice(["parameters", "arguments"])
        body = "; ".join(json.dumps({"name": n, key: a}) for n, a in calls)
        return rng.choice(["", " ", "<|python_tag|>"]) + body, None, calls
    body = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_python_literal(v)}" for k, v in a.items()) + ")"
                           for n, a in calls) + "]"
    return (f"<|python_start|>{body}<|python_end|>" if rng.random() < 0.3 else body), None, calls


@pytest.mark.parametrize("parser", ["mistral", "llama3_json", "pythonic"])
@pytest.mark.parametrize("seed", range(4))
def test_parsers_find_the_calls_whole_and_streamed_alike(parser, seed):
    rng = random.Random(seed)
    cls = TOOL_CALL_PARSERS.get(parser)
    for _ in range(25):
        answer, content, calls = write_answer(parser, rng)
        parsed = cls().parse(answer)
        assert parsed.content == (content if calls else answer), answer
        assert [(n, json.loads(a)) for n, a in parsed.calls] == calls, answer
        stream, sent, streamed, cut = cls(), "", [], 0
        while cut < len(answer) or cut == 0:
            cut = min(len(answer), cut + rng.randrange(1, 7))
            piece, new_calls = stream.stream(answer[:cut], finished=cut == len(answer))
            sent += piece
            streamed += new_calls
            assert answer.startswith(sent)                      # content comes in order, never ahead
            if cut == len(answer):
                break
        assert (sent or None) == (content or None) and streamed == parsed.calls, answer


@pytest.mark.parametrize("parser,answer", [
    ("mistral", 'ok [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]not json"),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and then text'),
    ("llama3_json", '{"parameters": {}}'),
    ("llama3_json", '<|python_tag|>'),
    ("pythonic", "[get_weather(city=paris)]"),
    ("pythonic", "[get_weather('Paris')]"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[get_weather(city=1e999)]"),
    ("pythonic", "[" * 5000),
])
def test_malformed_calls_stay_text(parser, answer):
    cls = TOOL_CALL_PARSERS.get(parser)
    parsed = cls().parse(answer)
    assert parsed.content == answer and parsed.calls == []
    content, calls = cls().stream(answer, finished=True)
    assert content == answer and calls == []


@pytest.fixture(scope="module")
def clients(async_engine):
    running = {}
    for name in ("mistral", "llama3_json", "pythonic"):
        app = build_app(async_engine, MODEL_NAME, tool_call_parser=name, enable_auto_tool_choice=True)
        running[name] = run_app_in_thread(app)
    yield {name: openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
           for name, (url, _, _) in running.items()}
    for _, server, thread in running.values():
        server.should_exit = True
        thread.join(30)


@pytest.mark.parametrize("parser", ["mistral", "llama3_json", "pythonic"])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_with_each_parser(clients, parser, stream):
    """The random model's answer is held to a text in the parser's format by a choice constraint; the server
    returns its calls with finish reason tool_calls."""
    answer, content, calls = write_answer(parser, random.Random(7 + len(parser)))
    while not calls:
        answer, content, calls = write_answer(parser, random.Random(len(answer) + 1))
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in NAMES]
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=300,
                  temperature=0, extra_body={"structured_outputs": {"choice": [answer]}})
    client = clients[parser]
    if not stream:
        reply = client.chat.completions.create(**kwargs).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == calls
        return
    got_content, got_calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            got_content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = got_calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and (got_content or None) == content
    assert [(n, json.loads(a)) for n, a in got_calls.values()] == calls
