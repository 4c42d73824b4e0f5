"""Function calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`, served as vLLM serves them.

- "none": the tools reach the chat template; the answer stays text.
- "auto" (the server's --enable-auto-tool-choice with a --tool-call-parser): the model decides, and the parser
  finds its calls in the text (tool_parsers.py: hermes, mistral, llama3_json, pythonic). Text before the first
  call is the message's content.
- "required", or one named function: a structured output holds the answer to the calls' JSON (an array of
  {"name", "parameters"} objects, or the named function's arguments), so the calls are well-formed by
  construction; no parser is needed.

Parsers are registered by name (TOOL_CALL_PARSERS), so a model family's format is a new class in tool_parsers.py.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pellucid.sampling_params import SamplingParams
from pellucid.server.protocol import ProtocolError
from pellucid.server.tool_parsers import TOOL_CALL_PARSERS, ParsedAnswer, ToolCallParser
from pellucid.structured import StructuredOutputsParams

__all__ = ["TOOL_CALL_PARSERS", "ParsedAnswer", "ToolCallParser", "ToolPlan", "ToolCallStream", "plan_tools",
           "with_tools", "tool_calls_of", "template_messages"]


class FunctionCall(BaseModel):
    name: str
    arguments: str          # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def _function(tool: Any, index: int) -> dict[str, Any]:
    if (not isinstance(tool, dict) or tool.get("type", "function") != "function"
            or not isinstance(tool.get("function"), dict) or not isinstance(tool["function"].get("name"), str)):
        raise ProtocolError(f"tools.{index} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}", param=f"tools.{index}")
    parameters = tool["function"].get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise ProtocolError(f"tools.{index}.function.parameters must be a JSON schema object",
                            param=f"tools.{index}")
    return {"name": tool["function"]["name"], "parameters": parameters}


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""
    mode: str                                   # "none" | "auto" | "required" | "named"
    functions: list[dict[str, Any]]             # {"name", "parameters"} of each offered tool
    named: str | None = None
    parser: type[ToolCallParser] | None = None
    parallel: bool = True                       # OpenAI's parallel_tool_calls: False allows one call

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that holds a required or named answer to its calls' JSON."""
        if self.mode == "named":
            parameters = next(f["parameters"] for f in self.functions if f["name"] == self.named)
            return StructuredOutputsParams(json=parameters)
        if self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]}}
                     for f in self.functions]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    @property
    def skip_special_tokens(self) -> bool | None:
        """False where a parser reads the answer: some models' call tags are special tokens."""
        return False if self.mode == "auto" else None

    def streamer(self) -> "ToolCallStream":
        return ToolCallStream(self)

    def answer(self, text: str) -> ParsedAnswer:
        """The finished answer split into content and calls."""
        if self.mode == "auto":
            assert self.parser is not None
            parsed = self.parser().parse(text)
            if not self.parallel:
                parsed.calls = parsed.calls[:1]
            return parsed
        if self.mode == "named":
            return ParsedAnswer(None, [(self.named, text)]) if text else ParsedAnswer(text)
        if self.mode == "required":
            try:
                items = json.loads(text)
                return ParsedAnswer(None, [(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                                           for item in items])
            except (ValueError, TypeError, KeyError):
                return ParsedAnswer(text)     # cut short (max_tokens): the text as it is
        return ParsedAnswer(text)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a forced named call keeps "stop"."""
        if called and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


class ToolCallStream:
    """One streamed choice of a request with tools: each `feed` of the answer so far gives the content and
    the tool-call deltas to send. Named calls stream their arguments as they come; a parser's calls go out
    whole as each closes; "required" calls go out whole at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = plan.parser() if plan.mode == "auto" and plan.parser is not None else None
        self.sent = 0                # characters of the answer sent (named: as arguments)
        self.num_calls = 0
        self.called = False          # the answer holds calls (for the finish reason)

    def feed(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        mode = self.plan.mode
        if mode == "auto":
            assert self.parser is not None
            content, calls = self.parser.stream(text, finished)
            if not self.plan.parallel:
                calls = calls[:max(0, 1 - self.num_calls)]
            return content or None, self._whole(calls)
        if mode == "named":
            piece, self.sent = text[self.sent:], len(text)
            if not piece:
                return None, []
            delta = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=piece))
            if not self.called:
                self.called = True
                delta.id, delta.type, delta.function.name = new_tool_call_id(), "function", self.plan.named
            return None, [delta]
        if mode == "required":
            if not finished:
                return None, []
            parsed = self.plan.answer(text)
            return parsed.content, self._whole(parsed.calls)
        piece, self.sent = text[self.sent:], len(text)
        return piece or None, []

    def _whole(self, calls: list[tuple[str, str]]) -> list[DeltaToolCall]:
        deltas = []
        for name, arguments in calls:
            deltas.append(DeltaToolCall(index=self.num_calls, id=new_tool_call_id(), type="function",
                                        function=DeltaFunctionCall(name=name, arguments=arguments)))
            self.num_calls += 1
        self.called = self.called or bool(deltas)
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return self.plan.finish_reason(reason, self.called)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parser: type[ToolCallParser] | None,
               auto_enabled: bool, parallel: bool = True) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); ProtocolError naming the field for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", param="tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ProtocolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}", param="tool_choice")
        if name not in {f["name"] for f in functions}:
            raise ProtocolError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolPlan("named", functions, named=name)
    if choice in ("none", "required"):
        return ToolPlan(choice, functions, parallel=parallel)
    if choice != "auto":
        raise ProtocolError(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                            param="tool_choice")
    if not auto_enabled or parser is None:
        raise ProtocolError('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                            '--tool-call-parser', param="tool_choice")
    return ToolPlan("auto", functions, parser=parser, parallel=parallel)


def with_tools(params: SamplingParams, plan: ToolPlan) -> SamplingParams:
    """The request's SamplingParams as its tools need them: a required or named call's constraint (refused
    beside another output constraint), and special tokens kept where a parser reads the answer."""
    changes: dict[str, Any] = {}
    constraint = plan.constraint()
    if constraint is not None:
        if params.structured_outputs is not None:
            raise ProtocolError("a required or named tool_choice cannot be combined with another output constraint",
                                param="tool_choice")
        try:
            constraint.check()
        except ValueError as exc:
            raise ProtocolError(f"the tools' parameter schemas cannot constrain the answer: {exc}",
                                param="tools") from exc
        changes["structured_outputs"] = constraint
    if plan.skip_special_tokens is not None:
        changes["skip_special_tokens"] = plan.skip_special_tokens
    return dataclasses.replace(params, **changes) if changes else params


def tool_calls_of(parsed: ParsedAnswer) -> list[ToolCall]:
    return [ToolCall(id=new_tool_call_id(), function=FunctionCall(name=name, arguments=arguments))
            for name, arguments in parsed.calls]


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages as templates want them: an assistant's call arguments as objects, not JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = dict(message, tool_calls=[_template_call(call) for call in calls])
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            pass        # not JSON: the template gets the text
    return dict(call, function=function)
