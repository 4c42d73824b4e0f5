"""A chat answer as a response reports it: the model's text split into reasoning (with a reasoning parser),
content and tool calls (with tools), whole or as a stream of deltas."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pellucid.server.reasoning import ReasoningParser
from pellucid.server.tool_calls import DeltaToolCall, ParsedAnswer, ToolCall, ToolCallStream, ToolPlan, tool_calls_of


@dataclass
class ChatAnswer:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str | None


def final_answer(text: str, finish_reason: str | None, tools: ToolPlan | None,
                 reasoning: ReasoningParser | None) -> ChatAnswer:
    thought, text = reasoning.split(text, finished=True) if reasoning is not None else ("", text)
    parsed = tools.answer(text) if tools is not None else ParsedAnswer(text)
    if tools is not None:
        finish_reason = tools.finish_reason(finish_reason, bool(parsed.calls))
    content = parsed.content if reasoning is None else (parsed.content or None)
    return ChatAnswer(thought or None, content, tool_calls_of(parsed), finish_reason)


class ChatAnswerStream:
    """One streamed choice: each `feed` of the text so far gives the deltas to send."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningParser | None) -> None:
        self.reasoning = reasoning
        self.tools: ToolCallStream | None = tools.streamer() if tools is not None else None
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[DeltaToolCall],
                                                                    str | None]:
        """(reasoning, content, tool calls, finish reason) new since the last feed."""
        finished = finish_reason is not None
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text, finished)
        new_thought, self.reasoning_sent = thought[self.reasoning_sent:], max(self.reasoning_sent, len(thought))
        calls: list[Any] = []
        if self.tools is not None:
            content, calls = self.tools.feed(text, finished)
            finish_reason = self.tools.finish_reason(finish_reason)
        else:
            content, self.content_sent = text[self.content_sent:] or None, max(self.content_sent, len(text))
        return new_thought or None, content, calls, finish_reason
