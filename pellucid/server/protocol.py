"""OpenAI-compatible request and response models (field names as OpenAI and vLLM spell them).

Unknown fields are ignored, as vLLM does, so clients that send newer OpenAI fields keep working (the
server log names each the first time it comes); a known field with a value of the wrong type is a 400
that names the field.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pellucid.logger import get_logger
from pellucid.sampling_params import SamplingParams
from pellucid.structured import StructuredOutputsParams

logger = get_logger(__name__)


class ProtocolError(ValueError):
    """A request the server refuses: becomes an OpenAI error body with this status and param."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_field_of(error: ValueError, default: str | None) -> str | None:
    """The request field an engine refusal names: a sampling parameter's message starts with its name."""
    first_word = str(error).split(" ", 1)[0]
    return first_word if first_word in _SAMPLING_FIELDS else default


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingRequest(_Lenient):
    """Fields shared by completions and chat, including vLLM's `extra_body` sampling extensions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None   # token id (a string, as JSON keys are) -> added to its logit
    # vLLM extensions (sent by the openai client through extra_body)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None      # per prompt token its logprob and the top alternatives (not streamed)
    allowed_token_ids: list[int] | None = None   # the only tokens the request may sample
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Pellucid tracing: a list of JSON ops, checked by pellucid/tracing/http.py (docs/tracing.md)
    interventions: Any = None

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise ProtocolError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, compiled once to refuse a bad one (ProtocolError naming
        the field); None without one."""
        given = {name: value for name, value in (
            ("response_format", _response_format_constraint(self.response_format)),
            ("structured_outputs", self.structured_outputs), ("guided_json", _named("json", self.guided_json)),
            ("guided_regex", _named("regex", self.guided_regex)), ("guided_choice", _named("choice", self.guided_choice)),
            ("guided_grammar", _named("grammar", self.guided_grammar))) if value is not None}
        if not given:
            return None
        if len(given) > 1:
            raise ProtocolError(f"ask for one output constraint, got {', '.join(given)}", param=list(given)[1])
        (field, value), = given.items()
        try:
            params = StructuredOutputsParams(**value)
            params.check()
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{field}: {exc}", param=field) from exc
        return params

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's SamplingParams; invalid values raise ProtocolError naming the field."""
        structured = self.structured_outputs_params()
        try:
            logit_bias = None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()}
        except ValueError as exc:
            raise ProtocolError(f"logit_bias keys must be token ids, got {list(self.logit_bias or ())!r}",
                                param="logit_bias") from exc
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                min_p=self.min_p, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens, logit_bias=logit_bias,
                allowed_token_ids=self.allowed_token_ids, structured_outputs=structured)
        except ValueError as exc:
            message = str(exc)
            # SamplingParams messages start with the offending field's name.
            field = message.split(" ", 1)[0]
            raise ProtocolError(message, param=field if field in type(self).model_fields else None) from exc

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _named(kind: str, value: Any) -> dict[str, Any] | None:
    return None if value is None else {kind: value}


def _response_format_constraint(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as a structured_outputs constraint: "text" none, "json_object" any JSON object,
    "json_schema" its json_schema.schema."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise ProtocolError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                                param="response_format")
        return {"json": spec["schema"]}
    raise ProtocolError(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                        param="response_format")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    # Pellucid hidden-state extraction: {"layers": [...], "output": "inline" | "server"}, checked by
    # pellucid/extraction/http.py (docs/extraction.md)
    extract_hidden_states: Any = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: strings or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ProtocolError("prompt must not be empty", param="prompt")
        return prompts

    def echo_only(self) -> bool:
        """OpenAI's echo with max_tokens 0: the prompt comes back (with its logprobs when asked), nothing is
        generated; how scoring harnesses read a prompt's loglikelihood."""
        return self.echo and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        # The engine always samples after a prompt, so an echo-only request runs for one token, which the
        # response drops (as vLLM does).
        return 1 if self.echo_only() else self.max_tokens

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo_only() and self.min_tokens > 0:
            raise ProtocolError("min_tokens must be 0 when echo asks for no tokens (max_tokens 0)",
                                param="min_tokens")
        if self.suffix:
            raise ProtocolError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ProtocolError("best_of different from n is not supported", param="best_of")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's calls, as OpenAI returned them
    tool_call_id: str | None = None                    # a "tool" message: the call it answers
    # An assistant turn's reasoning, sent back for interleaved thinking: vLLM's `reasoning`, or DeepSeek's older
    # `reasoning_content`. Templates read it as `reasoning_content` (Qwen3, DeepSeek) or `reasoning`.
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ProtocolError(f"only text content parts are supported, got type {part.type!r}",
                                    param=f"messages.{index}.content.{j}")
            parts.append(part.text)
        return "".join(parts)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def chat_template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the tokenizer's chat template wants them; empty lists and unknown roles are errors."""
    if not messages:
        raise ProtocolError("messages must contain at least one message", param="messages")
    out = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise ProtocolError(f"messages.{i}.role must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
                                param=f"messages.{i}.role")
        entry: dict[str, Any] = {"role": message.role, "content": message.text(i)}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning is not None:
            if message.role != "assistant":
                raise ProtocolError(f"messages.{i}: only an assistant message carries reasoning, not a "
                                    f"{message.role!r} one", param=f"messages.{i}.reasoning")
            entry["reasoning_content"] = entry["reasoning"] = reasoning
        out.append(entry)
    return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's audio output: modalities ["text", "audio"] and audio {"voice", "format"} (a speech pipeline
    # serves them, pellucid/server/omni_app.py; a text model refuses them).
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None

    def wants_audio(self) -> bool:
        """Whether the client asked for audio output (checked: known modalities, audio settings given)."""
        modalities = self.modalities or ["text"]
        unknown = [m for m in modalities if m not in ("text", "audio")]
        if unknown or "text" not in modalities:
            raise ProtocolError(f"modalities must be ['text'] or ['text', 'audio'], got {modalities}",
                                param="modalities")
        if "audio" in modalities and not self.audio:
            raise ProtocolError("audio output needs the audio parameter: {\"voice\": ..., \"format\": \"wav\"}",
                                param="audio")
        return "audio" in modalities

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise ProtocolError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.add_generation_prompt and self.continue_final_message:
            raise ProtocolError("add_generation_prompt and continue_final_message cannot both be true",
                                param="continue_final_message")

    def check_text_only(self) -> None:
        """A text model's server: audio output is refused, not ignored."""
        if self.wants_audio():
            raise ProtocolError("this model writes text only; audio output needs a speech model (e.g. Qwen3-Omni "
                                "served as a pipeline)", param="modalities")


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class CompletionLogprobs(BaseModel):
    # With echo the prompt's tokens come first; its first token has no logprob (null), as in OpenAI's API.
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int                       # 1-based, under the model's distribution at that position
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position (None for the first) token id -> its entry, for the prompt's token
# and the top alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None                             # with --reasoning-parser: the <think> part
    tool_calls: list[Any] = Field(default_factory=list)      # pellucid.server.tool_calls.ToolCall


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[Any] | None = None                      # pellucid.server.tool_calls.DeltaToolCall


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None       # default: True for prompt, False for messages
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "pellucid"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field_name(part: str) -> bool:
    # Field names are snake_case; union tags are type names ("str", "list[int]", "ContentPart").
    return part.isidentifier() and part.islower() and part not in _TYPE_TAGS


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(raw: bytes, model: type[RequestT], warned: set[str]) -> RequestT:
    """A request body as `model`; ProtocolError naming the problem. Top-level fields the model does not know are
    logged once each (`warned` remembers them for the server) and ignored."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError("request body must be a JSON object")
    try:
        parsed = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc
    unknown = set(data) - set(model.model_fields) - warned
    if unknown:
        warned |= unknown
        logger.warning("ignoring request field(s) this server does not support: %s", ", ".join(sorted(unknown)))
    return parsed


def validation_error(exc: ValidationError) -> ProtocolError:
    """The first pydantic error as a ProtocolError whose message and param name the field."""
    first = exc.errors()[0]
    # Union members add their type name to the location ("prompt", "str"); keep field names and indices.
    path = [str(p) for p in first["loc"] if isinstance(p, int) or _is_field_name(p)]
    field = ".".join(path) if path else None
    if first["type"] == "missing":
        return ProtocolError(f"field '{field}' is required", param=field)
    got = first.get("input")
    got_text = f" (got {got!r})" if got is not None and not isinstance(got, dict) else ""
    return ProtocolError(f"invalid value for field '{field}': {first['msg']}{got_text}", param=field)
