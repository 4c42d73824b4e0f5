"""Tool-call parsers: how a model family writes its calls in an answer, found by `tool_choice: "auto"`
(--tool-call-parser NAME, vLLM's names).

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the answer (Qwen, Hermes);
- mistral: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral's v3 tokenizers) or, per call,
  `[TOOL_CALLS]name[ARGS]{...}` (v11: Mistral Small 3.2, Magistral); text before it is content;
- llama3_json: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"), several separated by
  `;`, optionally after `<|python_tag|>` (Llama 3.1-3.3's JSON tool calling);
- pythonic: the whole answer is a Python list of calls, `[get_weather(city="Paris"), get_time()]`, optionally
  between `<|python_start|>` and `<|python_end|>` (Llama 3.2 and 4); the arguments must be literals.

Each returns the answer's content and its calls (name, arguments as JSON text), whole or streamed. A call
that does not parse leaves the answer (or that call) as text: nothing the model wrote is lost, and nothing
that is not a call is sent as one.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from pellucid.logger import get_logger
from pellucid.server.parser_registry import ParserRegistry

logger = get_logger(__name__)


@dataclass
class ParsedAnswer:
    """An answer split into its text and its calls (name, arguments as JSON text)."""
    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)


class ToolCallParser:
    """Finds a model's tool calls in its answer. One instance per response (a stream keeps its state here)."""

    name = ""

    def parse(self, text: str) -> ParsedAnswer:
        raise NotImplementedError

    def stream(self, text: str, finished: bool) -> tuple[str, list[tuple[str, str]]]:
        """Given the answer so far, the content not sent before and the calls completed since the last call."""
        raise NotImplementedError


TOOL_CALL_PARSERS: ParserRegistry[ToolCallParser] = ParserRegistry("tool-call parser")


def _call_from_json(body: str) -> tuple[str, str]:
    """(name, arguments JSON) of one call written {"name": ..., "arguments": {...}}; ValueError otherwise."""
    call = json.loads(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"a tool call needs a name: {body!r}")
    return call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False, allow_nan=False)


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (not sent until the next token decides)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class TaggedToolCallParser(ToolCallParser):
    """Calls written as JSON between a start and an end tag; the last one may lack its end tag (the answer
    stopped there). If any call is not valid JSON the whole answer stays text, as vLLM does."""

    start_tag = ""
    end_tag = ""

    def __init__(self) -> None:
        self._sent = 0           # characters of content sent
        self._calls_sent = 0     # calls sent

    def _regions(self, text: str, finished: bool) -> list[tuple[str, bool]]:
        """(body, closed by its end tag) of the complete calls and, once finished, of an unclosed last one."""
        bodies, position = [], text.find(self.start_tag)
        while position != -1:
            begin = position + len(self.start_tag)
            end = text.find(self.end_tag, begin)
            if end == -1:
                if finished:
                    bodies.append((text[begin:], False))
                break
            bodies.append((text[begin:end], True))
            position = text.find(self.start_tag, end + len(self.end_tag))
        return bodies

    def parse(self, text: str) -> ParsedAnswer:
        first = text.find(self.start_tag)
        if first == -1:
            return ParsedAnswer(text)
        try:
            calls = [_call_from_json(body.strip()) for body, _ in self._regions(text, finished=True)]
        except ValueError as exc:
            logger.warning("a tool call in the answer is not valid JSON, so the answer stays text: %s", exc)
            return ParsedAnswer(text)
        return ParsedAnswer(text[:first] or None, calls)

    def stream(self, text: str, finished: bool) -> tuple[str, list[tuple[str, str]]]:
        first = text.find(self.start_tag)
        if first == -1:
            sendable = len(text) if finished else len(text) - held_back(text, self.start_tag)
        else:
            sendable = first
        content = text[self._sent:sendable] if sendable > self._sent else ""
        self._sent = max(self._sent, sendable)
        regions = self._regions(text, finished) if first != -1 else []
        calls: list[tuple[str, str]] = []
        for body, closed in regions[self._calls_sent:]:
            try:
                calls.append(_call_from_json(body.strip()))
            except ValueError:      # sent as text instead: nothing the model wrote is lost
                content += self.start_tag + body + (self.end_tag if closed else "")
        self._calls_sent = len(regions)
        return content, calls


@TOOL_CALL_PARSERS.register
class HermesToolCallParser(TaggedToolCallParser):
    name = "hermes"
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"


# What a malformed answer raises while its calls are read (a deeply nested literal exhausts the parser's stack).
_UNPARSED = (ValueError, SyntaxError, RecursionError)


class TrailingCallsParser(ToolCallParser):
    """Formats whose calls fill the rest of the answer once they begin, so they are complete only when the
    answer ends: a stream sends the content before them as it comes and the calls at the end. If the calls
    do not parse, the whole rest of the answer is text."""

    def __init__(self) -> None:
        self._sent = 0
        self._done = False

    def find(self, text: str) -> int:
        """Where the calls begin in `text`, or -1."""
        raise NotImplementedError

    def undecided(self, text: str) -> int:
        """With no calls found yet: how many characters at the end of `text` may still begin them."""
        raise NotImplementedError

    def calls(self, body: str) -> list[tuple[str, str]]:
        """The calls written in `body` (the answer from find() on); ValueError if they do not parse."""
        raise NotImplementedError

    def parse(self, text: str) -> ParsedAnswer:
        start = self.find(text)
        if start == -1:
            return ParsedAnswer(text)
        try:
            calls = self.calls(text[start:])
        except _UNPARSED as exc:
            logger.warning("the tool calls in the answer do not parse, so the answer stays text: %s", exc)
            return ParsedAnswer(text)
        return ParsedAnswer(text[:start] or None, calls)

    def stream(self, text: str, finished: bool) -> tuple[str, list[tuple[str, str]]]:
        start = self.find(text)
        if start == -1:
            sendable = len(text) if finished else len(text) - self.undecided(text)
        else:
            sendable = start
        content = text[self._sent:sendable] if sendable > self._sent else ""
        self._sent = max(self._sent, sendable)
        calls: list[tuple[str, str]] = []
        if finished and start != -1 and not self._done:
            self._done = True
            try:
                calls = self.calls(text[start:])
            except _UNPARSED:
                content += text[start:]
        return content, calls


class AnchoredCallsParser(TrailingCallsParser):
    """Calls that are the whole answer: it begins (after whitespace) with one of `openings`."""

    openings: tuple[str, ...] = ()

    def find(self, text: str) -> int:
        return 0 if text.lstrip().startswith(self.openings) else -1

    def undecided(self, text: str) -> int:
        begun = text.lstrip()
        return len(text) if any(opening.startswith(begun) for opening in self.openings) else 0


def _arguments_json(arguments: object, body: str) -> str:
    if not isinstance(arguments, dict):
        raise ValueError(f"a tool call's arguments must be an object: {body!r}")
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _object_call(call: object, body: str, argument_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str]:
    """(name, arguments JSON) of a call written {"name": ..., <an argument key>: {...}}; ValueError otherwise."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f"a tool call needs a name: {body!r}")
    arguments = next((call[key] for key in argument_keys if key in call), {})
    return call["name"], _arguments_json(arguments, body)


@TOOL_CALL_PARSERS.register
class MistralToolCallParser(TrailingCallsParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def find(self, text: str) -> int:
        return text.find(self.marker)

    def undecided(self, text: str) -> int:
        return held_back(text, self.marker)

    def calls(self, body: str) -> list[tuple[str, str]]:
        calls = []
        for piece in body.split(self.marker)[1:]:
            piece = piece.strip()
            if "[ARGS]" in piece:          # v11: name[ARGS]{...}
                name, arguments = (part.strip() for part in piece.split("[ARGS]", 1))
                if not name:
                    raise ValueError(f"a tool call needs a name: {piece!r}")
                calls.append((name, _arguments_json(json.loads(arguments), piece)))
                continue
            items = json.loads(piece)      # v3: a JSON array of calls (or one call)
            calls.extend(_object_call(item, piece) for item in (items if isinstance(items, list) else [items]))
        if not calls:
            raise ValueError("the answer names no call after [TOOL_CALLS]")
        return calls


@TOOL_CALL_PARSERS.register
class Llama3JsonToolCallParser(AnchoredCallsParser):
    name = "llama3_json"
    openings = ("<|python_tag|>", "{")

    def calls(self, body: str) -> list[tuple[str, str]]:
        body = body.strip().removeprefix("<|python_tag|>").strip()
        decoder, calls, position = json.JSONDecoder(), [], 0
        while position < len(body):
            call, position = decoder.raw_decode(body, position)
            calls.append(_object_call(call, body, ("parameters", "arguments")))
            rest = body[position:].lstrip()
            if rest and not rest.startswith(";"):
                raise ValueError(f"tool calls must be separated by ';': {body!r}")
            position = len(body) - len(rest.removeprefix(";").lstrip())
        if not calls:
            raise ValueError("the answer names no call after <|python_tag|>")
        return calls


@TOOL_CALL_PARSERS.register
class PythonicToolCallParser(AnchoredCallsParser):
    name = "pythonic"
    openings = ("<|python_start|>", "[")

    def calls(self, body: str) -> list[tuple[str, str]]:
        body = body.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError(f"pythonic tool calls must be a non-empty list of calls: {body!r}")
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ValueError(f"each pythonic tool call is name(keyword=literal, ...): {ast.unparse(node)!r}")
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(arguments) != len(node.keywords):
                raise ValueError(f"a pythonic tool call cannot unpack **arguments: {ast.unparse(node)!r}")
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        return calls
