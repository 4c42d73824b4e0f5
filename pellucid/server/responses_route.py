"""`/v1/responses`: OpenAI's Responses API over the chat path (create, streamed or not, in the foreground or the
background; retrieve, cancel and delete stored responses, and list their input items).

A response runs as the chat completion its request translates to (responses_request.py) and reports the answer
as output items (responses_output.py). With --responses-store-size N the server keeps its last N responses in
memory, so a client may fetch one again or continue its conversation with `previous_response_id` (the stored
conversation and output come before the new input; the old instructions do not, as in OpenAI's API). Without it
nothing is kept: such a response says `"store": false`, and `previous_response_id`, item references
(responses_items.py) and background responses (responses_background.py) are refused.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pellucid.engine.async_llm import RequestStream
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.server.chat_answer import ChatAnswerStream, final_answer
from pellucid.server.disconnect import EventStream, until_disconnect
from pellucid.server.metrics import RequestTimer
from pellucid.server.protocol import ProtocolError
from pellucid.server.responses import ChoiceTracker
from pellucid.server.responses_background import BackgroundRun, EventLog
from pellucid.server.responses_items import page, resolve_references, with_ids
from pellucid.server.responses_output import (ResponseEvents, logprobs_of, new_item_id, output_items, reasoning_tokens,
                                              response_body, status_of, usage)
from pellucid.server.responses_request import ResponsesRequest, responses_param, stored_items
from pellucid.server.tool_calls import ToolPlan, plan_tools, with_tools

if TYPE_CHECKING:
    from pellucid.server.app import OpenAIServer

logger = get_logger(__name__)


@dataclass
class _Stored:
    body: dict[str, Any]
    items: list[dict[str, Any]]             # what a later response continues from
    log: EventLog | None = None             # a background response's events
    inputs: list[dict[str, Any]] = field(default_factory=list)     # its own input items, with ids


class ResponseStore:
    """The last `capacity` stored responses (least recently used out first): each one's body, the items a later
    response continues from, and a background response's events."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, _Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response_id: str, body: dict[str, Any], items: list[dict[str, Any]],
            log: EventLog | None = None, inputs: list[dict[str, Any]] | None = None) -> None:
        """Store (or update) a response; an update keeps the events and input items it had."""
        earlier = self._entries.get(response_id)
        if earlier is not None:
            log = log or earlier.log
            inputs = earlier.inputs if inputs is None else inputs
        self._entries[response_id] = _Stored(body, items, log, inputs or [])
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def entry(self, response_id: str) -> _Stored:
        if not self.enabled:
            raise ProtocolError("this server keeps no responses; start it with --responses-store-size N to store "
                                "them", param="response_id", status=404, code="not_found")
        entry = self._entries.get(response_id)
        if entry is None:
            raise ProtocolError(f"no stored response {response_id!r} (never stored, deleted, or evicted: the store "
                                f"keeps the last {self.capacity})", param="response_id", status=404,
                                code="not_found")
        self._entries.move_to_end(response_id)
        return entry

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        entry = self.entry(response_id)
        return entry.body, entry.items

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def find_item(self, item_id: str) -> dict[str, Any] | None:
        """The stored input or output item with this id, newest response first (None when none holds it)."""
        for entry in reversed(self._entries.values()):
            for item in entry.inputs + entry.items:
                if item.get("id") == item_id:
                    return item
        return None


class ServerResponses:
    """The routes of /v1/responses for one OpenAIServer."""

    def __init__(self, server: "OpenAIServer", store_size: int = 0) -> None:
        self.server = server
        self.store = ResponseStore(store_size)
        self.running: dict[str, BackgroundRun] = {}     # background responses not finished yet

    async def create(self, request: Request) -> Response:
        server = self.server
        timer = RequestTimer(server.metrics)
        body = await server.parse(request, ResponsesRequest)
        server.check_model(body.model)
        body.check_unsupported()
        if body.background:
            self._check_background(body)
        if body.reasoning and "reasoning" not in server.ignored_fields:
            server.ignored_fields.add("reasoning")
            logger.warning("ignoring the Responses field 'reasoning' (effort, summary): whether a model thinks is its "
                           "chat template's choice (chat_template_kwargs, e.g. {\"enable_thinking\": false})")
        conversation = with_ids(resolve_references(body.input_items(), self.store.find_item))
        inputs = conversation
        if body.previous_response_id is not None:
            if not self.store.enabled:
                raise ProtocolError("previous_response_id needs stored responses: start the server with "
                                    "--responses-store-size N", param="previous_response_id")
            try:
                _, earlier = self.store.get(body.previous_response_id)
            except ProtocolError as exc:
                raise ProtocolError(exc.message, param="previous_response_id") from exc
            conversation = earlier + conversation
        try:
            chat = body.to_chat(conversation)
            tools = plan_tools(chat.tools, chat.tool_choice, server.tool_call_parser, server.enable_auto_tool_choice,
                               chat.parallel_tool_calls)
            prompt_ids = server.chat_prompt(chat, chat.messages)
            params = chat.sampling_params(chat.effective_max_tokens(), chat.num_logprobs())
            if tools is not None:
                params = with_tools(params, tools)
            response_id = new_item_id("resp")
            streams = await server.add_all([prompt_ids], params, response_id, param="messages")
        except ProtocolError as exc:
            exc.param = responses_param(exc.param)
            raise
        stored = body.store and self.store.enabled
        run = _Run(self, body, response_id, conversation, inputs, tools, stored, time.time())
        tracker = ChoiceTracker(n=1)
        if body.background:
            return self._start_background(run, streams, tracker, timer)
        if body.stream:
            return EventStream(_events(run, streams, tracker, timer))
        finals: dict[int, RequestOutput] = {}
        await until_disconnect(request, server._collect(streams, tracker, timer, finals))
        return JSONResponse(run.finished(finals[0]))

    async def retrieve(self, request: Request) -> Response:
        """The stored response; with `?stream=true`, a background response's events after `starting_after`."""
        entry = self.store.entry(request.path_params["response_id"])
        if request.query_params.get("stream", "false").lower() not in ("true", "1"):
            return JSONResponse(entry.body)
        if entry.log is None:
            raise ProtocolError("only background responses can be streamed again", param="stream")
        after = request.query_params.get("starting_after", "-1")
        try:
            start = int(after)
        except ValueError:
            raise ProtocolError(f"starting_after must be an event's sequence number, got {after!r}",
                                param="starting_after") from None
        return EventStream(entry.log.follow(start))

    async def input_items(self, request: Request) -> Response:
        """A stored response's own input items, a page at a time (`limit`, `order`, `after`, as OpenAI's)."""
        entry = self.store.entry(request.path_params["response_id"])
        query = request.query_params
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            raise ProtocolError(f"limit must be an integer, got {query.get('limit')!r}", param="limit") from None
        return JSONResponse(page(entry.inputs, query.get("order", "desc"), query.get("after"), limit))

    async def cancel(self, request: Request) -> Response:
        """Stop a background response; it ends `cancelled` with the output it had. A finished one is returned as
        it ended (cancelling twice is harmless)."""
        response_id = request.path_params["response_id"]
        body, _ = self.store.get(response_id)
        if not body.get("background"):
            raise ProtocolError("only background responses can be cancelled", param="response_id")
        running = self.running.get(response_id)
        if running is not None:
            await self.stop(response_id, running)
        body, _ = self.store.get(response_id)
        return JSONResponse(body)

    async def close(self) -> None:
        """Cancel the background responses still running (the server is stopping)."""
        for response_id, running in list(self.running.items()):
            await self.stop(response_id, running)

    async def stop(self, response_id: str, running: BackgroundRun) -> None:
        """Cancel a background response's task and wait for it to store the response as cancelled."""
        running.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running.task
        if self.running.pop(response_id, None) is not None:
            # Cancelled before it first ran: none of its code ran, so end it here.
            for stream in running.streams:
                stream.cancel()
            running.run.ended("cancelled", [])
            running.log.close()

    def _check_background(self, body: ResponsesRequest) -> None:
        if not self.store.enabled:
            raise ProtocolError("background responses are polled from the server's store: start it with "
                                "--responses-store-size N", param="background")
        if not body.store:
            raise ProtocolError("a background response must be stored (store: true)", param="store")

    def _start_background(self, run: "_Run", streams: list[RequestStream], tracker: ChoiceTracker,
                          timer: RequestTimer) -> Response:
        """Store the response as queued and run it in a task; a streamed one's events follow its log."""
        queued = run.response("queued", [])
        log = EventLog()
        self.store.put(run.response_id, queued, stored_items(run.conversation, []), log, run.inputs)
        task = asyncio.get_running_loop().create_task(self._run_background(run, streams, tracker, timer, log))
        self.running[run.response_id] = BackgroundRun(task, log, run, streams)
        return EventStream(log.follow()) if run.body.stream else JSONResponse(queued)

    async def _run_background(self, run: "_Run", streams: list[RequestStream], tracker: ChoiceTracker,
                              timer: RequestTimer, log: EventLog) -> None:
        events = ResponseEvents()
        try:
            self.store.put(run.response_id, run.response("in_progress", []), stored_items(run.conversation, []))
            async with contextlib.aclosing(_events(run, streams, tracker, timer, events)) as pieces:
                async for piece in pieces:
                    log.append(piece)
        except asyncio.CancelledError:      # (its engine request was aborted as the cancel reached its reader)
            for piece in events.finish("abort", run.body.num_logprobs is not None) if events.open else []:
                log.append(piece)
            body = run.ended("cancelled", events.items)
            log.append(events.lifecycle("response.incomplete", body))
        finally:
            log.close()
            self.running.pop(run.response_id, None)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


class _Run:
    """One response being made: what its body echoes, and where it is stored when done."""

    def __init__(self, routes: ServerResponses, body: ResponsesRequest, response_id: str,
                 conversation: list[dict[str, Any]], inputs: list[dict[str, Any]], tools: ToolPlan | None,
                 stored: bool, created_at: float) -> None:
        self.routes = routes
        self.body = body
        self.response_id = response_id
        self.conversation = conversation        # earlier turns, then this input
        self.inputs = inputs                    # this input alone
        self.tools = tools
        self.stored = stored
        self.created_at = created_at

    def response(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return response_body(self.body, self.response_id, self.created_at, self.routes.server.model_name, status,
                             output, self.stored, **fields)

    def usage(self, final: RequestOutput) -> dict[str, Any]:
        server = self.routes.server
        completion = final.outputs[0]
        decode = lambda ids: server.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        return usage(final, completion, reasoning_tokens(completion, server.reasoning_parser, decode))

    def done(self, final: RequestOutput, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response's body, stored when asked for."""
        status, incomplete = status_of(final.outputs[0].finish_reason)
        return self.ended(status, output, usage=self.usage(final), incomplete=incomplete)

    def ended(self, status: str, output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """The body of a response that ended (finished, cancelled or failed), stored when asked for."""
        body = self.response(status, output, **fields)
        if self.stored:
            self.routes.store.put(self.response_id, body, stored_items(self.conversation, output),
                                  inputs=self.inputs)
        return body

    def finished(self, final: RequestOutput) -> dict[str, Any]:
        """The non-streamed response for the engine's final output."""
        completion = final.outputs[0]
        parser = self.routes.server.reasoning_parser
        answer = final_answer(completion.text, completion.finish_reason, self.tools, parser)
        return self.done(final, output_items(answer, logprobs_of(completion, 0, self.body.num_logprobs)))


async def _events(run: _Run, streams: list[RequestStream], tracker: ChoiceTracker, timer: RequestTimer,
                  events: ResponseEvents | None = None) -> AsyncIterator[str]:
    """The SSE body: created and in_progress, the items' events as the answer grows, then completed or
    incomplete (failed, with the error, if the request fails). `events`: the numbering and items to continue."""
    server = run.routes.server
    events = events if events is not None else ResponseEvents()
    answer = ChatAnswerStream(run.tools, server.reasoning_parser)
    yield events.lifecycle("response.created", run.response("in_progress", []))
    yield events.lifecycle("response.in_progress", run.response("in_progress", []))
    try:
        final = None
        async with contextlib.aclosing(server.merged(streams, timer, tracker)) as outputs:
            async for _, output in outputs:
                for delta in tracker.update(0, output):
                    reasoning, content, calls, finish = answer.feed(delta.output.text, delta.finish_reason)
                    logprobs = logprobs_of(delta.output, delta.token_start, run.body.num_logprobs)
                    for piece in ((events.reasoning(reasoning) if reasoning else [])
                                  + events.text(content or "", logprobs) + events.calls(calls)):
                        yield piece
                    if finish is not None:
                        for piece in events.finish(delta.output.finish_reason, run.body.num_logprobs is not None):
                            yield piece
                if output.finished:
                    final = output
        assert final is not None
        body = run.done(final, events.items)
        # OpenAI streams no event of its own for a cancelled response: it ends as one that did not complete.
        yield events.lifecycle("response.completed" if body["status"] == "completed" else "response.incomplete",
                               body)
    except Exception as exc:
        error = server._stream_error(exc)
        code = "invalid_prompt" if error.status == 400 else "server_error"
        yield events.lifecycle("response.failed", run.ended("failed", events.items,
                                                            error={"code": code, "message": error.message}))
