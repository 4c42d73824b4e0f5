"""OpenAI's Responses API (`POST /v1/responses`), the request side: its body, and the conversation it asks for
as the chat completion this server already knows how to run.

A Responses request is a chat request spelled differently: `input` items instead of `messages`, `instructions`
as the system turn, `max_output_tokens`, flat function tools, `text.format` for structured output. `to_chat`
translates it, so the prompt, the sampling, the tool plan and the reasoning split are the chat path's own
(pellucid/server/app.py). What cannot be served (built-in tools, image or file inputs, automatic truncation) is
refused by name.
"""
from __future__ import annotations

import json
from typing import Any

from pellucid.server.protocol import ChatCompletionRequest, ChatMessage, ProtocolError, _Lenient

# `include` values this server fills; OpenAI's others (file search results, encrypted reasoning, ...) name
# features it does not have.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
SUPPORTED_INCLUDES = (LOGPROBS_INCLUDE,)

# The roles of a message item, as the chat template knows them: OpenAI's "developer" is the system turn.
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Chat-path parameter names -> the Responses field a client sent (for the error's `param`).
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "max_completion_tokens": "max_output_tokens", "logprobs": "include"}


def responses_param(param: str | None) -> str | None:
    """The Responses field behind a chat-path error's param ("messages.3.content" -> "input")."""
    if param is None:
        return None
    head = param.split(".", 1)[0]
    return _PARAMS.get(head, param) if head in _PARAMS else param


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    truncation: str | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's sampling extensions, as on the chat route (sent by the openai client through extra_body)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    structured_outputs: dict[str, Any] | None = None     # vLLM's constraint, instead of text.format
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        if self.truncation not in (None, "disabled"):
            raise ProtocolError(f"truncation must be 'disabled' (a prompt longer than the model's context is "
                                f"refused, not cut), got {self.truncation!r}", param="truncation")
        if self.max_tool_calls is not None:
            raise ProtocolError("max_tool_calls is not supported by this server", param="max_tool_calls")
        unknown = [name for name in self.include or () if name not in SUPPORTED_INCLUDES]
        if unknown:
            raise ProtocolError(f"include may name {', '.join(SUPPORTED_INCLUDES)}; not supported: "
                                f"{', '.join(unknown)}", param="include")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ProtocolError(f"max_output_tokens must be an integer >= 1, got {self.max_output_tokens}",
                                param="max_output_tokens")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ProtocolError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token in the message's logprobs (0: the chosen token's alone); None without logprobs.
        They are asked for by `include`, or by `top_logprobs` alone."""
        if LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None:
            return self.top_logprobs or 0
        return None

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as a list of items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        if not self.input and self.previous_response_id is None:
            raise ProtocolError("input must not be empty", param="input")
        return list(self.input)

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs: `conversation` (earlier turns and this input, as items) after
        the instructions, with this request's sampling, tools and output format."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else [])
        messages += chat_messages(conversation)
        fields: dict[str, Any] = {
            "messages": [ChatMessage.model_validate(m) for m in messages],
            "max_completion_tokens": self.max_output_tokens, "parallel_tool_calls": self.parallel_tool_calls,
            "logprobs": self.num_logprobs is not None, "top_logprobs": self.num_logprobs,
            "tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
            "response_format": response_format(self.text), "structured_outputs": self.structured_outputs,
            "chat_template_kwargs": self.chat_template_kwargs,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty, "seed": self.seed,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens, "skip_special_tokens": self.skip_special_tokens,
            "logit_bias": self.logit_bias}
        if self.temperature is not None:
            fields["temperature"] = self.temperature
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        return ChatCompletionRequest(**fields)


def _text_of(content: Any, param: str) -> str:
    """A message item's content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ProtocolError(f"{param} must be a string or a list of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ProtocolError(f"only text content parts (input_text, output_text) are supported, got "
                                f"{kind!r}", param=f"{param}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: message items by role; a model's function calls as one assistant
    turn's tool_calls (so parallel calls stay one turn); their outputs as tool messages; a reasoning item as the
    reasoning of the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None

    def assistant_turn() -> dict[str, Any]:
        """The assistant turn that the next function call joins: the last message if it is an assistant's
        and no other turn came after it, else a new one."""
        nonlocal reasoning
        if not messages or messages[-1]["role"] != "assistant" or reasoning is not None:
            messages.append({"role": "assistant", "content": ""})
        turn = messages[-1]
        if reasoning is not None:
            turn["reasoning"], reasoning = reasoning, None
        return turn

    for i, item in enumerate(items):
        param = f"input.{i}"
        if not isinstance(item, dict):
            raise ProtocolError(f"{param} must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))     # type: ignore[arg-type]
            if role is None:
                raise ProtocolError(f"{param}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}",
                                    param=f"{param}.role")
            text = _text_of(item.get("content"), f"{param}.content")
            if role == "assistant":
                turn = {"role": "assistant", "content": text}
                if reasoning is not None:
                    turn["reasoning"], reasoning = reasoning, None
                messages.append(turn)
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, arguments, call_id)):
                raise ProtocolError(f"{param}: a function_call item needs name, arguments and call_id strings",
                                    param=param)
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ProtocolError(f"{param}: a function_call_output item needs its call_id", param=param)
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        else:
            raise ProtocolError(f"{param}: input items may be message, function_call, function_call_output or "
                                f"reasoning, got {kind!r}", param=f"{param}.type")
    if not messages:
        raise ProtocolError("input must hold at least one message", param="input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) in the chat form."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ProtocolError(f"tools.{i}: only function tools ({{\"type\": \"function\", \"name\": ..., "
                                f"\"parameters\": {{...}}}}) are supported, got type {kind!r}", param=f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses tool_choice in the chat form: the strings as they are, {"type": "function", "name"} nested."""
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ProtocolError("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                                param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat route's response_format."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ProtocolError("text.format must be an object", param="text.format")
    kind = spec.get("type", "text")
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), (dict, bool)):
            raise ProtocolError("text.format json_schema needs {\"type\": \"json_schema\", \"name\": ..., "
                                "\"schema\": {...}}", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name", "output"), "schema": spec["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ProtocolError(f"text.format type must be text, json_object or json_schema, got {kind!r}",
                        param="text.format")


def stored_items(conversation: list[dict[str, Any]], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items a later response continues from: this one's conversation, then its output (as JSON-safe
    copies, so a stored response cannot change under a caller that keeps the dicts)."""
    return json.loads(json.dumps(conversation + output))
