"""Background responses (`background: true` on /v1/responses) through the official openai client: a polled
response ends as the foreground one would; a cancelled one stops, keeps its output so far and frees its blocks; a
streamed one survives its client's disconnect and its events resume from a sequence number; a failing one is stored
as failed; a server without a store refuses them."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from pellucid.engine.async_llm import AsyncLLM
from pellucid.server.app import build_app
from server_harness import ENGINE_KWARGS, MODEL_NAME, RunningServer, random_prompts, run_app_in_thread, wait_until
from tests.step_faults import failing_step, slowed_steps

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def background_server(server_model_dir):
    """A server with `--responses-store-size 8`, its engine in this process."""
    llm = AsyncLLM(server_model_dir, served_model_name=MODEL_NAME, engine_process=False, **ENGINE_KWARGS)
    running = RunningServer(*run_app_in_thread(build_app(llm, MODEL_NAME, responses_store_size=8)), llm=llm)
    yield running
    running.stop()
    llm.shutdown()


@pytest.fixture(scope="module")
def client(background_server):
    return openai.OpenAI(base_url=background_server.base_url, api_key="unused", max_retries=0, timeout=120)


def _poll(client, response_id: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in TERMINAL or time.monotonic() > deadline:
            return response
        time.sleep(0.02)


def _sse(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("seed", range(2))
def test_a_polled_background_response_ends_as_the_foreground_one(client, seed):
    """Greedy: created queued (background, stored), then polled to the foreground response's output, status and
    token counts; a later response continues from it."""
    kwargs = dict(model=MODEL_NAME, input=random_prompts(seed + 30, 1)[0], max_output_tokens=12 + 9 * seed,
                  temperature=0)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background is True and queued.store is True and not queued.output
    done = _poll(client, queued.id)
    foreground = client.responses.create(**kwargs)
    assert done.status == foreground.status and done.status in ("completed", "incomplete")
    assert done.output_text == foreground.output_text
    assert done.usage.output_tokens == foreground.usage.output_tokens
    assert done.usage.input_tokens == foreground.usage.input_tokens
    follow = client.responses.create(model=MODEL_NAME, input="next", previous_response_id=done.id,
                                     max_output_tokens=2)
    assert follow.usage.input_tokens > foreground.usage.input_tokens


def test_a_cancelled_background_response_stops_and_frees_its_blocks(client, background_server):
    """Cancelled while it runs (steps slowed to 20 ms): status cancelled, the output it had, its KV blocks back;
    cancelling again returns the same response; a foreground response cannot be cancelled."""
    llm = background_server.llm
    with slowed_steps(llm, 0.02):
        started = client.responses.create(model=MODEL_NAME, input="tell me a long story", background=True,
                                          max_output_tokens=400, extra_body={"ignore_eos": True})
        wait_until(lambda: client.responses.retrieve(started.id).status == "in_progress")
        wait_until(lambda: any(r.num_output_tokens >= 3 for r in list(llm.engine.scheduler.running)))
        cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.background is True
    assert client.responses.retrieve(started.id).model_dump() == cancelled.model_dump()
    assert client.responses.cancel(started.id).model_dump() == cancelled.model_dump()
    text = cancelled.output_text
    assert 0 < len(text) and (cancelled.usage is None or cancelled.usage.output_tokens < 400)
    wait_until(lambda: llm.get_stats().num_used_blocks == 0)
    foreground = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(foreground.id)
    assert "only background responses" in refused.value.body["message"]


def test_a_streamed_background_response_survives_a_disconnect_and_resumes(client, background_server):
    """The client leaves after a few events; the response goes on, and GET ?stream=true&starting_after=N gives
    the events after N: together every sequence number once, ending with the stored response."""
    url, llm = background_server.url, background_server.llm
    body = {"model": MODEL_NAME, "input": "count to ten", "max_output_tokens": 40, "temperature": 0,
            "background": True, "stream": True, "ignore_eos": True}
    with slowed_steps(llm, 0.01):
        with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=60) as stream:
            first = []
            for line in stream.iter_lines():
                first += _sse([line])
                if len(first) >= 4:
                    break
    assert first[0]["type"] == "response.created" and first[0]["response"]["background"] is True
    response_id = first[0]["response"]["id"]
    last_seen = first[-1]["sequence_number"]
    with httpx.stream("GET", f"{url}/v1/responses/{response_id}",
                      params={"stream": "true", "starting_after": last_seen}, timeout=60) as resumed:
        rest = _sse(resumed.iter_lines())
    events = first + rest
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"      # cut short by max_output_tokens
    stored = httpx.get(f"{url}/v1/responses/{response_id}", timeout=10).json()
    assert stored["status"] == "incomplete" and stored["incomplete_details"] == {"reason": "max_output_tokens"}
    assert stored["usage"]["output_tokens"] == 40
    assert events[-1]["response"] == stored
    # From the start again, after it ended: the same events.
    with httpx.stream("GET", f"{url}/v1/responses/{response_id}", params={"stream": "true"}, timeout=60) as again:
        assert _sse(again.iter_lines()) == events
    foreground = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    replay = httpx.get(f"{url}/v1/responses/{foreground.id}", params={"stream": "true"}, timeout=10)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"


def test_a_failing_background_response_is_stored_as_failed(client, background_server):
    llm = background_server.llm
    with failing_step(llm):
        queued = client.responses.create(model=MODEL_NAME, input="the cat", background=True, max_output_tokens=4)
        failed = _poll(client, queued.id)
    assert failed.status == "failed" and "injected step failure" in failed.error.message
    wait_until(lambda: llm.get_stats().num_used_blocks == 0)


def test_background_needs_a_store(client, server):
    """store: false is refused; so is any background response on a server that keeps none."""
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL_NAME, input="x", background=True, store=False)
    assert unstored.value.body["param"] == "store"
    refused = httpx.post(f"{server.base_url}/responses", timeout=30,
                         json={"model": MODEL_NAME, "input": "x", "background": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"


def test_a_response_cancelled_before_its_task_ran_still_ends_cancelled():
    """The task of a background response may be cancelled before its first step, when none of its code (and so
    none of its clean-up) runs: stopping it still aborts its engine requests, stores it cancelled, ends its events."""
    import asyncio

    from pellucid.server.responses_background import BackgroundRun, EventLog
    from pellucid.server.responses_route import ServerResponses

    class Stream:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    class Run:
        ended_with = None

        def ended(self, status, output):
            self.ended_with = (status, output)

    async def never_runs():
        raise AssertionError("the task ran")

    async def scenario():
        routes = ServerResponses(server=None, store_size=2)
        stream, run, log = Stream(), Run(), EventLog()
        running = BackgroundRun(asyncio.get_running_loop().create_task(never_runs()), log, run, [stream])
        routes.running["resp_1"] = running
        await routes.stop("resp_1", running)       # no await between create_task and here: it has not started
        async def follow():
            return [event async for event in log.follow()]
        followed = await asyncio.wait_for(follow(), timeout=5)     # an unclosed log would never end
        return routes, stream, run, log, followed

    routes, stream, run, log, followed = asyncio.run(scenario())
    assert stream.cancelled and run.ended_with == ("cancelled", []) and log.done and followed == []
    assert routes.running == {}
