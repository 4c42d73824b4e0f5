"""OpenAI's Responses API (`/v1/responses`) through the official openai client: answers equal the offline engine
on the prompt transformers' chat template renders, streamed equals whole (the client's own stream accumulator
checks the events), reasoning and function calls come as their items, a conversation of items reaches the template
as the chat messages it stands for, stored responses continue with previous_response_id, and what cannot be served
is a 400 naming the field."""
from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pellucid.engine.async_llm import AsyncLLM
from pellucid.sampling_params import SamplingParams
from pellucid.server.app import build_app
from server_harness import ENGINE_KWARGS, MODEL_NAME, RunningServer, random_prompts, run_app_in_thread, wait_until
from tests.log_records import pellucid_log_records
from tests.step_faults import failing_step

STORE_SIZE = 4
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": TOOL["name"], "parameters": TOOL["parameters"]}}


@pytest.fixture(scope="module")
def responses_server(server_model_dir):
    """A server as `pellucid serve --reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes
    --responses-store-size 4` builds it."""
    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, engine_process=False, **ENGINE_KWARGS)
    running = RunningServer(*run_app_in_thread(build_app(
        llm, MODEL_NAME, reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True,
        responses_store_size=STORE_SIZE)), llm=llm)
    yield running.url
    running.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(responses_server):
    return openai.OpenAI(base_url=f"{responses_server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server_model_dir):
    return AutoTokenizer.from_pretrained(server_model_dir)


def _template_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _items(response) -> list[dict]:
    """Output items without their generated ids (which differ between two runs of one answer)."""
    out = []
    for item in response.output:
        entry = item.model_dump(exclude_none=True)
        for key in ("id", "call_id"):
            entry.pop(key, None)
        out.append(entry)
    return out


@pytest.mark.parametrize("seed", range(2))
def test_answers_equal_the_offline_engine_on_the_templated_prompt(client, reference_llm, tokenizer, seed):
    """instructions + input, greedy: the text, the token counts and the status equal LLM.generate on the prompt
    transformers renders (system turn first); a cut-short answer is incomplete (max_output_tokens)."""
    rng = random.Random(seed)
    for prompt, instructions in zip(random_prompts(seed, 3), ["Answer briefly.", None, "You are terse."]):
        max_tokens = rng.randint(3, 40)
        messages = ([{"role": "system", "content": instructions}] if instructions else [])
        ids = _template_ids(tokenizer, messages + [{"role": "user", "content": prompt}])
        ref = reference_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                     use_tqdm=False)[0].outputs[0]
        response = client.responses.create(model=MODEL_NAME, input=prompt, instructions=instructions,
                                           max_output_tokens=max_tokens, temperature=0)
        assert response.output_text == ref.text
        assert response.usage.input_tokens == len(ids) and response.usage.output_tokens == len(ref.token_ids)
        assert response.usage.total_tokens == len(ids) + len(ref.token_ids)
        assert response.usage.output_tokens_details.reasoning_tokens == 0      # no <think> in a random answer
        if ref.finish_reason == "length":
            assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        else:
            assert response.status == "completed" and response.incomplete_details is None
        assert response.instructions == instructions and response.max_output_tokens == max_tokens
        assert [item.type for item in response.output] == ["message"]


def test_logprobs_are_the_offline_engines(client, reference_llm, tokenizer):
    """include message.output_text.logprobs with top_logprobs 3: per generated token its text, logprob and the
    top 3, as LLM.generate reports them; the tokens' texts make up the answer."""
    prompt = "the quick brown fox"
    ids = _template_ids(tokenizer, [{"role": "user", "content": prompt}])
    ref = reference_llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=12, logprobs=3),
                                 use_tqdm=False)[0].outputs[0]
    response = client.responses.create(model=MODEL_NAME, input=prompt, max_output_tokens=12, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=3)
    part = response.output[0].content[0]
    assert len(part.logprobs) == len(ref.token_ids)
    assert "".join(entry.token for entry in part.logprobs) == response.output_text == ref.text
    for entry, tid, position in zip(part.logprobs, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(position[tid].logprob, abs=1e-5)
        expected = sorted((e.rank, e.logprob) for e in position.values() if e.rank <= 3)
        assert [top.logprob for top in entry.top_logprobs] == pytest.approx([lp for _, lp in expected], abs=1e-5)


def _stream(client, **kwargs):
    """(event types, final response) of a streamed response, through the client's accumulator, which checks that
    items are added before their deltas, done once, and complete at the end."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events], final


@pytest.mark.parametrize("seed", range(2))
def test_streamed_equals_whole(client, seed):
    """Sampled with a seed, ended by a stop string: the streamed response's final output, status and usage equal
    the whole one's, and its events open with created / in_progress and close with completed."""
    kwargs = dict(model=MODEL_NAME, input=random_prompts(seed + 10, 1)[0], max_output_tokens=60, temperature=0.9,
                  extra_body={"seed": seed, "stop": ["e"]})
    whole = client.responses.create(**kwargs)
    types, final = _stream(client, **kwargs)
    assert whole.status == final.status == "completed"
    assert _items(final) == _items(whole) and final.output_text == whole.output_text
    # (cached_tokens may differ: the second run finds the first one's prompt in the prefix cache)
    for field in ("input_tokens", "output_tokens", "total_tokens"):
        assert getattr(final.usage, field) == getattr(whole.usage, field)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert types.count("response.output_text.delta") >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_text_and_calls_come_as_items(client, stream):
    """The random model's answer is held to <think>...</think> + text + a hermes call by a constraint: a reasoning
    item, a message, a function_call; reasoning_tokens counts the answer's tokens through </think>."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    answer = "<think>\nsmall steps\n</think>\n\nSo: " + call
    kwargs = dict(model=MODEL_NAME, input="go", max_output_tokens=120, temperature=0, tools=[TOOL],
                  include=["message.output_text.logprobs"], extra_body={"structured_outputs": {"choice": [answer]}})
    if stream:
        types, response = _stream(client, **kwargs)
        assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types
    else:
        response = client.responses.create(**kwargs)
    reasoning, message, function_call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "\nsmall steps\n"
    assert message.type == "message" and message.content[0].text == "\n\nSo: "
    assert function_call.type == "function_call" and function_call.name == "get_weather"
    assert json.loads(function_call.arguments) == {"city": "Oslo"} and function_call.call_id
    assert response.status == "completed"
    # The tokens' texts (logprobs ride on the message): the first reasoning_tokens of them end with </think>.
    tokens = [entry.token for entry in message.content[0].logprobs]
    thought = response.usage.output_tokens_details.reasoning_tokens
    assert "".join(tokens[:thought]).endswith("</think>") and "</think>" not in "".join(tokens[:thought - 1])
    if not stream:
        assert len(tokens) == response.usage.output_tokens and "".join(tokens) == answer


def test_a_conversation_of_items_reaches_the_template_as_its_chat(client, tokenizer):
    """developer, user, an assistant's reasoning + text + two parallel calls, and their outputs: the prompt counts
    what transformers renders for the chat messages these stand for."""
    items = [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "},
                                     {"type": "input_text", "text": "Oslo?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Bergen"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
    ]
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bergen"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
    ]
    expected = tokenizer.apply_chat_template(messages, tools=[CHAT_TOOL], add_generation_prompt=True, tokenize=False)
    # (the template renders the reasoning of an assistant turn after the last user message)
    assert all(text in expected for text in ("Be exact.", "Oslo?", "look it up", "Checking.", "Bergen", "sun"))
    response = client.responses.create(model=MODEL_NAME, input=items, tools=[TOOL], tool_choice="none",
                                       max_output_tokens=2, temperature=0)
    assert response.usage.input_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])


def test_stored_responses_continue_and_are_evicted(client, tokenizer):
    """previous_response_id puts the stored turn (its input and output, not its instructions) before the new
    input; GET returns a stored response, DELETE removes it, the store keeps the last 4, store=false keeps none."""
    first = client.responses.create(model=MODEL_NAME, input="hello there", instructions="Be brief.",
                                    max_output_tokens=6, temperature=0)
    assert first.store is True
    second = client.responses.create(model=MODEL_NAME, input="and then", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then"}]
    assert second.usage.input_tokens == len(_template_ids(tokenizer, chat))
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    unstored = client.responses.create(model=MODEL_NAME, input="x", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)

    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    for _ in range(STORE_SIZE):
        client.responses.create(model=MODEL_NAME, input="y", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as gone:
        client.responses.create(model=MODEL_NAME, input="z", previous_response_id=first.id, max_output_tokens=2)
    assert gone.value.body["param"] == "previous_response_id"


def test_input_items_are_listed_and_referenced_by_id(client, tokenizer):
    """GET .../input_items lists a response's own input items with ids (newest first by default, in pages); an
    item_reference to one of them, or to an output item, stands for that item in a later input."""
    made = client.responses.create(model=MODEL_NAME, max_output_tokens=4, temperature=0, input=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"}, {"role": "user", "content": [
            {"type": "input_text", "text": "second "}, {"type": "input_text", "text": "question"}]}])
    listed = list(client.responses.input_items.list(made.id, order="asc"))
    assert [(item.role, item.content[0].text) for item in listed] == [
        ("developer", "Be brief."), ("user", "first question"), ("assistant", "an answer"), ("user", "second ")]
    assert len(listed[3].content) == 2 and all(item.id.startswith("msg_") for item in listed)
    newest = client.responses.input_items.list(made.id, limit=2)
    assert [item.id for item in newest.data] == [listed[3].id, listed[2].id] and newest.has_more
    rest = client.responses.input_items.list(made.id, limit=2, after=newest.data[-1].id)
    assert [item.id for item in rest.data] == [listed[1].id, listed[0].id] and not rest.has_more
    for bad, param in (({"order": "sideways"}, "order"), ({"limit": 0}, "limit"), ({"after": "msg_x"}, "after")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.input_items.list(made.id, **bad)
        assert refused.value.body["param"] == param

    referenced = client.responses.create(model=MODEL_NAME, max_output_tokens=2, temperature=0, input=[
        {"type": "item_reference", "id": listed[1].id}, {"type": "item_reference", "id": made.output[-1].id},
        {"role": "user", "content": "and?"}])
    chat = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": made.output_text},
            {"role": "user", "content": "and?"}]
    assert referenced.usage.input_tokens == len(_template_ids(tokenizer, chat))
    assert [item.type for item in client.responses.input_items.list(referenced.id, order="asc")] == ["message"] * 3


def test_a_server_without_a_store_refuses_what_needs_one(server):
    """The default server keeps nothing: its responses say store false, GET is 404, previous_response_id a 400
    (background responses too: tests/server/test_responses_background.py)."""
    made = httpx.post(f"{server.base_url}/responses", timeout=60,
                      json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2})
    assert made.status_code == 200 and made.json()["store"] is False, made.text
    assert httpx.get(f"{server.base_url}/responses/{made.json()['id']}", timeout=10).status_code == 404
    refused = httpx.post(f"{server.base_url}/responses", timeout=60, json={
        "model": MODEL_NAME, "input": "hi", "previous_response_id": made.json()["id"]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"


def test_a_failing_request_is_a_500_or_a_failed_event_and_frees_its_blocks(threaded_server):
    """An engine failure ends that response alone: non-streamed a 500, streamed a response.failed event whose
    response says why; the KV blocks come back."""
    body = {"model": MODEL_NAME, "input": "the cat", "max_output_tokens": 4}
    with failing_step(threaded_server.llm) as fail_next_step:
        whole = httpx.post(f"{threaded_server.base_url}/responses", json=body, timeout=60)
        assert whole.status_code == 500 and "injected step failure" in whole.json()["error"]["message"]
        fail_next_step()
        with httpx.stream("POST", f"{threaded_server.base_url}/responses", json=dict(body, stream=True),
                          timeout=60) as stream:
            events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert "injected step failure" in failed["response"]["error"]["message"]
    wait_until(lambda: threaded_server.llm.get_stats().num_used_blocks == 0)
    ok = httpx.post(f"{threaded_server.base_url}/responses", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1


@pytest.mark.parametrize("body,param", [
    ({"input": []}, "input"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input.0.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.id"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"background": True, "store": False}, "store"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(responses_server, body, param):
    response = httpx.post(f"{responses_server}/v1/responses", timeout=30,
                          json={"model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, **body})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_json_schema_output_follows_the_schema(client, tokenizer):
    """text.format json_schema holds the answer to the schema (whitespace-only tokens banned: a random model would
    fill the grammar's optional blanks until the limit)."""
    no_blank = {str(t): -100 for t in range(len(tokenizer)) if not tokenizer.decode([t]).strip()}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL_NAME, input="answer", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
                                       extra_body={"logit_bias": no_blank})
    assert response.status == "completed"
    answer = json.loads(response.output_text)
    assert list(answer) == ["ok"] and isinstance(answer["ok"], bool)


def test_reasoning_settings_are_ignored_with_one_warning(responses_server):
    import logging
    with pellucid_log_records() as records:
        for _ in range(2):
            response = httpx.post(f"{responses_server}/v1/responses", timeout=60, json={
                "model": MODEL_NAME, "input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"}})
            assert response.status_code == 200 and response.json()["reasoning"] == {"effort": "low"}
    warned = [r for r in records if "'reasoning'" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
