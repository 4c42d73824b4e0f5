"""Bad input gets its status and a message naming the field; auth; one failing request does not stop the server."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from server_harness import MODEL_NAME, start_server, wait_until
from tests.log_records import pellucid_log_records
from tests.step_faults import failing_step

CHAT = [{"role": "user", "content": "hello"}]

# (route, body, status, field the error must name; None where no single field is at fault)
BAD_REQUESTS = [
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1 + i % 500 for i in range(600)]}, 400, "prompt"),   # longer than max_model_len
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": "two"}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    # More sequences than the engine runs at once (max_num_seqs, 256 by default): one request must not queue
    # any number of engine requests (2**63 made the server allocate until it ran out of memory).
    ("completions", {"prompt": "hi", "n": 257}, 400, "n"),
    ("chat/completions", {"messages": CHAT, "n": 2**63}, 400, "n"),
    # Integers past 64 bits: the engine's messages cannot carry them (they were a 500 from its encoder).
    ("completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("chat/completions", {"messages": CHAT, "seed": -2**64}, 400, "seed"),
    ("completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k"),
    ("completions", {"prompt": "hi", "max_tokens": 2**63}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 2**64}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stop_token_ids": [2**64]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "hi", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    # More alternatives than the engine's max_logprobs (20): every row of a step would carry that many.
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 100000}, 400, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "logprobs": "x"}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"max_tokens": 3}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "model": "no-such-model"}, 404, "model"),
]


def good_request_succeeds(server) -> None:
    response = httpx.post(f"{server.base_url}/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] is not None


@pytest.mark.parametrize("route,body,status,field", BAD_REQUESTS)
def test_bad_input_gets_its_status_and_names_the_field(server, route, body, status, field):
    url = f"{server.base_url}/{route}"
    if isinstance(body, str):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    else:
        response = httpx.post(url, json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if field is not None:
        assert error["param"] == field
        assert field.split(".")[0] in error["message"]
    good_request_succeeds(server)


def test_unknown_fields_are_ignored_with_a_warning_once(server):
    """As OpenAI's and vLLM's servers do, an unknown field does not fail the request; the server log names it,
    once per field."""
    import logging
    with pellucid_log_records() as records:
        for _ in range(2):
            response = httpx.post(f"{server.base_url}/completions", timeout=60,
                                  json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "frobnicate": {"x": 1},
                                        "temperature": 0})
            assert response.status_code == 200, response.text
    warned = [r for r in records if "frobnicate" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING, [r.getMessage() for r in warned]
    assert "temperature" not in warned[0].getMessage()


def test_internal_failure_of_one_request_is_a_500_and_the_server_keeps_serving(threaded_server):
    server = threaded_server
    with failing_step(server.llm) as fail_next_step:
        response = httpx.post(f"{server.base_url}/completions", timeout=60,
                              json={"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 4})
        assert response.status_code == 500
        assert "injected step failure" in response.json()["error"]["message"]
        fail_next_step()
        with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=60,
                          json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert any('"error"' in line and "injected step failure" in line for line in lines)
        assert lines[-1] == "data: [DONE]"
    good_request_succeeds(server)
    wait_until(lambda: server.llm.get_stats().num_used_blocks == 0)


def test_api_key_is_required_when_set(async_engine):
    secured = start_server(async_engine, api_key="sekret")
    try:
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        missing = httpx.post(f"{secured.base_url}/completions", json=body, timeout=60)
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(f"{secured.base_url}/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert httpx.get(f"{secured.base_url}/models", timeout=60).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=secured.base_url, api_key="nope", max_retries=0).completions.create(**body)
        ok = openai.OpenAI(base_url=secured.base_url, api_key="sekret", max_retries=0).completions.create(**body)
        assert ok.usage.completion_tokens >= 1
        assert httpx.get(f"{secured.url}/health", timeout=60).status_code == 200
    finally:
        secured.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_exclude_every_token_are_the_clients_error(server, stream):
    """allowed_token_ids inside the min_tokens ban of EOS: no token can be drawn, which shows only when the
    request samples. Not an engine failure: a 400 (a client that retries 5xx would repeat it for nothing), or
    in a started stream an error event of type invalid_request_error."""
    eos = sorted(server.llm.info.eos_token_ids)[0]
    body = {"model": MODEL_NAME, "prompt": "the cat", "max_tokens": 4, "min_tokens": 2,
            "allowed_token_ids": [eos], "stream": stream}
    if not stream:
        response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        assert "no token satisfies" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "invalid_request_error"
        return
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(line[6:])["error"] for line in lines if '"error"' in line]
    assert errors and errors[0]["type"] == "invalid_request_error" and "no token satisfies" in errors[0]["message"]
    assert lines[-1] == "data: [DONE]"
