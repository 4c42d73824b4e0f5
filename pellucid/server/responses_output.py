"""OpenAI's Responses API, the output side: a chat answer (pellucid/server/chat_answer.py) as the Response
object's output items, its usage, and, streamed, as the typed events that build the same items.

Items, in the order the model wrote them: a `reasoning` item (with --reasoning-parser), a `message` with one
`output_text` part, then one `function_call` item per call. The text part carries the logprobs of the generated
tokens when asked for (as chat completions' `logprobs.content` does: reasoning tokens included; streamed, those of
tokens after the message closes, before a function call, are not sent). A response whose answer ran out of tokens is
`incomplete` ("max_output_tokens").
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from pellucid.outputs import CompletionOutput, RequestOutput
from pellucid.server.chat_answer import ChatAnswer
from pellucid.server.reasoning import ReasoningParser
from pellucid.server.responses import chat_logprobs
from pellucid.server.responses_request import ResponsesRequest
from pellucid.server.tool_calls import DeltaToolCall


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) for the answer's finish reason: cut short by its token limit, incomplete; aborted
    (a cancelled background response, or the server shutting down), cancelled."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def logprobs_of(output: CompletionOutput, start: int, top_logprobs: int | None) -> list[dict[str, Any]] | None:
    """Logprobs of output positions [start:] in the output_text part's form, with `top_logprobs` alternatives each
    (None: none asked for)."""
    if top_logprobs is None:
        return None
    return [entry.model_dump() for entry in chat_logprobs(output, start, top_logprobs).content]


def reasoning_tokens(output: CompletionOutput, parser: ReasoningParser | None,
                     decode: Callable[[list[int]], str]) -> int:
    """How many generated tokens are reasoning: those up to the one that completes the end tag (all of them when
    the answer ended inside its reasoning)."""
    if parser is None:
        return 0
    thought, _ = parser.split(output.text, finished=True)
    if not thought and not output.text.startswith(parser.start_tag):
        return 0
    ids = output.token_ids
    if parser.end_tag not in output.text:
        return len(ids)
    low, high = 1, len(ids)         # the shortest prefix whose text holds the end tag
    while low < high:
        mid = (low + high) // 2
        if parser.end_tag in decode(ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return low


def usage(request: RequestOutput, output: CompletionOutput, reasoning: int) -> dict[str, Any]:
    prompt, generated = len(request.prompt_token_ids), len(output.token_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": request.num_cached_tokens},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + generated}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": parts}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(answer: ChatAnswer, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The finished answer's output items."""
    status, _ = status_of(answer.finish_reason)
    items = []
    if answer.reasoning:
        items.append(reasoning_item(new_item_id("rs"), answer.reasoning, "completed"))
    if answer.content or not (answer.tool_calls or answer.reasoning):
        items.append(message_item(new_item_id("msg"), [text_part(answer.content or "", logprobs)], status))
    for call in answer.tool_calls:
        items.append(call_item(new_item_id("fc"), call.id, call.function.name, call.function.arguments, "completed"))
    return items


def response_body(request: ResponsesRequest, response_id: str, created_at: float, model: str, status: str,
                  output: list[dict[str, Any]], stored: bool, usage: dict[str, Any] | None = None,
                  incomplete: dict[str, str] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
    """The Response object, echoing the request's settings as OpenAI does."""
    return {
        "id": response_id, "object": "response", "created_at": int(created_at), "status": status,
        "completed_at": int(time.time()) if status == "completed" else None, "model": model, "output": output,
        "error": error, "incomplete_details": incomplete, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "previous_response_id": request.previous_response_id,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p, "top_logprobs": request.top_logprobs,
        "tools": request.tools or [], "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
        "parallel_tool_calls": request.parallel_tool_calls,
        "text": request.text or {"format": {"type": "text"}}, "reasoning": request.reasoning,
        "truncation": "disabled", "metadata": request.metadata or {}, "user": request.user, "store": stored,
        "background": request.background, "usage": usage}


class ResponseEvents:
    """A streamed response's events: `feed` each answer delta (pellucid.server.chat_answer.ChatAnswerStream's),
    `finish` at the end. Items open as the model starts them and close when the next one starts or the answer
    ends; `items` are the output as it stands, so the final response equals the non-streamed one."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open = False               # the last item still takes deltas
        self.pending_logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def lifecycle(self, kind: str, body: dict[str, Any]) -> str:
        return self.event(kind, response=body)

    def _current(self, kind: str) -> dict[str, Any] | None:
        if self.open and self.items[-1]["type"] == kind:
            return self.items[-1]
        return None

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[str]:
        """Close the open item, open `item` (with its first content part)."""
        events = self.close("completed")
        self.items.append(item)
        self.open = True
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item=dict(item, content=[]) if part is not None else item))
        if part is not None:
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        return events

    def reasoning(self, delta: str) -> list[str]:
        item = self._current("reasoning")
        events = []
        if item is None:
            item = reasoning_item(new_item_id("rs"), "", "in_progress")
            events += self._start(item, {"type": "reasoning_text", "text": ""})
        item["content"][0]["text"] += delta
        events.append(self.event("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=delta))
        return events

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        """Text of the message; `logprobs` (None when not asked for) of the tokens generated since the last
        feed, sent with the next text delta."""
        if logprobs is not None:
            self.pending_logprobs += logprobs
        if not delta:
            return []
        item = self._current("message")
        events = []
        if item is None:
            with_logprobs = [] if logprobs is not None else None
            item = message_item(new_item_id("msg"), [text_part("", with_logprobs)], "in_progress")
            events += self._start(item, text_part("", with_logprobs))
        part = item["content"][0]
        part["text"] += delta
        sent, self.pending_logprobs = self.pending_logprobs, []
        if "logprobs" in part:
            part["logprobs"] += sent
        events.append(self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                 content_index=0, delta=delta, logprobs=sent))
        return events

    def calls(self, deltas: list[DeltaToolCall]) -> list[str]:
        events = []
        for delta in deltas:
            item = self._current("function_call")
            if delta.id is not None or item is None:     # a new call
                item = call_item(new_item_id("fc"), delta.id or new_item_id("call"), delta.function.name or "", "",
                                 "in_progress")
                events += self._start(item, None)
            if delta.function.arguments:
                item["arguments"] += delta.function.arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=len(self.items) - 1, delta=delta.function.arguments))
        return events

    def close(self, status: str) -> list[str]:
        """Close the open item (a message that ran out of tokens closes `incomplete`)."""
        if not self.open:
            return []
        self.open = False
        item, index = self.items[-1], len(self.items) - 1
        events = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
            item["status"] = "completed"
        elif item["type"] == "message":
            part = item["content"][0]
            if "logprobs" in part and self.pending_logprobs:
                part["logprobs"] += self.pending_logprobs
                self.pending_logprobs = []
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=part.get("logprobs", [])))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
            item["status"] = status
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
            item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finish(self, finish_reason: str | None, wants_logprobs: bool) -> list[str]:
        """Close the last item; an answer with no item at all still gets its (empty) message, as the non-streamed
        response has."""
        status, _ = status_of(finish_reason)
        events = []
        if not self.items:
            empty = [] if wants_logprobs else None
            events += self._start(message_item(new_item_id("msg"), [text_part("", empty)], "in_progress"),
                                  text_part("", empty))
        return events + self.close(status)
