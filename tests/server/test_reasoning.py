"""Reasoning outputs: the parsers split an answer the same whole and streamed (on random answers), and a server
run with --reasoning-parser qwen3 returns the <think> part in `reasoning`, apart from the content and its tool
calls, through the openai client."""
from __future__ import annotations

import json
import random

import openai
import pytest

from pellucid.engine.async_llm import AsyncLLM
from pellucid.server.app import build_app
from pellucid.server.chat_answer import ChatAnswerStream
from pellucid.server.reasoning import REASONING_PARSERS
from server_harness import ENGINE_KWARGS, MODEL_NAME, run_app_in_thread


def _random_answer(rng: random.Random) -> str:
    parts = [rng.choice(["", "<think>", "<think>\n", "<thi", "x<think>"]), rng.choice(["", "step one, ", "a < b"]),
             rng.choice(["", "</think>", "</think>\n\n", "</thi"]), rng.choice(["", "The answer.", "<think>again"])]
    return "".join(parts)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("seed", range(3))
def test_streamed_split_equals_the_whole_split(name, seed):
    rng = random.Random(seed)
    parser = REASONING_PARSERS.get(name)()
    for _ in range(60):
        answer = _random_answer(rng)
        reasoning, content = parser.split(answer, finished=True)
        stream, got_reasoning, got_content, cut = ChatAnswerStream(None, parser), "", "", 0
        while cut < len(answer) or cut == 0:
            cut = min(len(answer), cut + rng.randrange(1, 4))
            thought, text, calls, _ = stream.feed(answer[:cut], "stop" if cut == len(answer) else None)
            got_reasoning += thought or ""
            got_content += text or ""
            assert not calls
            if cut == len(answer):
                break
        assert (got_reasoning, got_content) == (reasoning, content), answer
    if name == "qwen3":
        assert parser.split("plain answer", True) == ("", "plain answer")
        assert parser.split("<think>cut short", True) == ("cut short", "")
    else:
        assert parser.split("thought</think>answer", True) == ("thought", "answer")


@pytest.fixture(scope="module")
def thinking_server(server_model_dir):
    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, engine_process=False, **ENGINE_KWARGS)
    url, server, thread = run_app_in_thread(build_app(llm, MODEL_NAME, reasoning_parser="qwen3",
                                                      tool_call_parser="hermes", enable_auto_tool_choice=True))
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=30)
    llm.shutdown()


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_apart_from_content_and_tool_calls(thinking_server, stream):
    """The random model's answer is held to `<think>...</think>` + text + a hermes call by a constraint."""
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    answer = "<think>\nsmall steps\n</think>\n\nSo: " + call
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "go"}], max_tokens=120, temperature=0,
                  tools=tools, extra_body={"structured_outputs": {"choice": [answer]}})
    if stream:
        reasoning = content = arguments = ""
        finish = None
        for chunk in thinking_server.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                reasoning += getattr(choice.delta, "reasoning", None) or ""
                content += choice.delta.content or ""
                arguments += "".join(c.function.arguments or "" for c in choice.delta.tool_calls or [])
                finish = choice.finish_reason or finish
    else:
        choice = thinking_server.chat.completions.create(**kwargs).choices[0]
        reasoning, content, finish = choice.message.reasoning, choice.message.content, choice.finish_reason
        arguments = "".join(c.function.arguments for c in choice.message.tool_calls)
    assert reasoning == "\nsmall steps\n" and content == "\n\nSo: " and finish == "tool_calls"
    assert json.loads(arguments) == {"x": 1}
    plain = thinking_server.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "go"}],
                                                    max_tokens=4, temperature=0)
    assert getattr(plain.choices[0].message, "reasoning", None) is None


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_sent_back_reaches_the_chat_template(server, server_model_dir, field):
    """Interleaved thinking: an assistant turn's reasoning, sent back under vLLM's `reasoning` (or DeepSeek's
    `reasoning_content`), is rendered by the template as transformers renders `reasoning_content`."""
    import httpx
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server_model_dir)
    messages = [{"role": "user", "content": "two plus two?"},
                {"role": "assistant", "content": "four", field: "the sum of two and two"},
                {"role": "user", "content": "and three plus three?"}]
    reply = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
    assert reply.status_code == 200, reply.text
    expected = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"], **({"reasoning_content": m[field]} if field in m else {})}
         for m in messages], add_generation_prompt=True, tokenize=True)
    expected = list(expected if isinstance(expected, list) else expected["input_ids"])
    assert reply.json()["tokens"] == expected
    assert "<think>the sum of two and two</think>four" in tokenizer.decode(reply.json()["tokens"])
    refused = httpx.post(f"{server.url}/tokenize", timeout=60,
                         json={"messages": [{"role": "user", "content": "hi", field: "x"}]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages.0.reasoning"
