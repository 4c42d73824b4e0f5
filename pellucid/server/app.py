"""The OpenAI-compatible FastAPI app over an AsyncLLM.

Request bodies are parsed by hand (not by FastAPI's validation) so every refusal is an OpenAI-style
error body with the right status: 400 for bad input, 401 for a bad API key, 404 for an unknown
model, 500 when one request fails inside the engine (the server keeps serving), 503 when the engine
is down. A client that disconnects, streaming or not, aborts its requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import pellucid
from pellucid.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from pellucid.engine.input_processor import ExtrasError
from pellucid.extraction.sink import EXTRACTION_KEY
from pellucid.extraction.http import ExtractionRequest, ServerExtraction
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.pooling.config import PoolerConfig
from pellucid.sampling_params import SamplingParams
from pellucid.server.classify import ServerClassifications
from pellucid.server.embeddings import ServerEmbeddings
from pellucid.server.scores import ServerScores
from pellucid.server.disconnect import ClientDisconnected, EventStream, until_disconnect
from pellucid.server.metrics import RequestTimer, ServerMetrics, log_stats_periodically
from pellucid.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                      ChatCompletionResponse, ChatResponseMessage, ChatStreamChoice,
                                      CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage,
                                      DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard,
                                      ModelList, ProtocolError, TokenizeRequest, TokenizeResponse,
                                      chat_template_messages, new_id, parse_request, sampling_field_of)
from pellucid.server.responses import (ChoiceTracker, Delta, chat_logprobs, completion_logprobs, echo_logprobs,
                                       prompt_logprobs)
from pellucid.server.responses_route import ServerResponses
from pellucid.server.chat_answer import ChatAnswerStream, final_answer
from pellucid.server.reasoning import REASONING_PARSERS
from pellucid.server.tool_calls import TOOL_CALL_PARSERS, ToolPlan, plan_tools, template_messages, with_tools
from pellucid.tokenizer import apply_chat_template
from pellucid.tracing.http import trace_extras, with_saves
from pellucid.tracing.plan import TRACE_KEY

logger = get_logger(__name__)

ModelT = TypeVar("ModelT", bound=BaseModel)

# Request features (engine extras keys) and the request field each comes from.
_EXTRAS_FIELDS = {TRACE_KEY: "interventions", EXTRACTION_KEY: "extract_hidden_states"}


def error_response_body(error: ProtocolError) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=error.message, type=error.error_type, param=error.param,
                                         code=error.code if error.code is not None else error.status)).model_dump()


def error_response(error: ProtocolError) -> JSONResponse:
    return JSONResponse(error_response_body(error), status_code=error.status)


def _internal_error(message: str) -> ProtocolError:
    return ProtocolError(message, status=500, error_type="internal_server_error")


def _observe(timer: RequestTimer, tracker: ChoiceTracker, output: RequestOutput) -> None:
    """Latency metrics for an output the response just took in (after tracker.update)."""
    timer.observe(tracker.num_generated)
    if output.finished:
        for completion in output.outputs:
            timer.finish(completion.finish_reason or "unknown")


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class OpenAIServer:
    """Routes and per-request plumbing; one instance per app."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, extract_dir: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None, pooler_config: dict[str, Any] | str | None = None,
                 responses_store_size: int = 0) -> None:
        self.llm = llm
        # chat answers' <think> part goes to the message's `reasoning` (pellucid/server/reasoning.py)
        self.reasoning_parser = REASONING_PARSERS.get(reasoning_parser)() if reasoning_parser else None
        # tool_choice "auto": the parser that finds calls in answers (pellucid/server/tool_calls.py)
        self.tool_call_parser = TOOL_CALL_PARSERS.get(tool_call_parser) if tool_call_parser else None
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.model_name = served_model_name
        self.tokenizer = llm.tokenizer
        self.metrics = ServerMetrics(served_model_name)
        self.lm_head = llm.info.lm_head          # the head's describe(); its row counters come with the stats
        self.metrics.set_lm_head(self.lm_head)
        self.extraction = ServerExtraction(llm, extract_dir)   # the extract_hidden_states field
        self.embeddings = ServerEmbeddings(self, pooler_config)  # /v1/embeddings
        self.classifications = ServerClassifications(self)       # /classify
        self.scores = ServerScores(self)                         # /v1/score, /v1/rerank
        self.responses = ServerResponses(self, responses_store_size)  # /v1/responses
        self.ignored_fields: set[str] = set()    # request fields this server does not know, warned about once each

    # ---- plumbing ----------------------------------------------------------------------------

    async def parse(self, request: Request, model: type[ModelT]) -> ModelT:
        return parse_request(await request.body(), model, self.ignored_fields)

    def trace_extras(self, body: Any) -> dict[str, Any] | None:
        """Engine extras for the request's `interventions` (pellucid/tracing/http.py); None without them."""
        try:
            return trace_extras(body.interventions, body.n)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="interventions") from exc

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ProtocolError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                                param="model", status=404, code="model_not_found")

    async def add_all(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                      param: str, extras: dict[str, Any] | None = None) -> list[RequestStream]:
        """Queue one engine request per prompt; if any is refused, abort the ones already queued."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.llm.add_request(prompt, params, rid, extras=extras))
        except ValueError as exc:
            for stream in streams:
                stream.cancel()
            if isinstance(exc, ExtrasError):     # the request field that carried the feature's value
                param = _EXTRAS_FIELDS.get(exc.key, param)
            else:
                param = sampling_field_of(exc, param)
            raise ProtocolError(str(exc), param=param) from exc
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        return streams

    async def finals(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str, param: str,
                     extras: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Queue one request per prompt (add_all) and wait for each one's final output."""
        streams = await self.add_all(prompts, params, request_id, param, extras=extras)
        finals = []
        try:
            for stream in streams:
                final = None
                async for output in stream:
                    final = output
                finals.append(final)
        finally:
            for stream in streams:
                stream.cancel()
        return finals

    async def merged(self, streams: list[RequestStream], timer: RequestTimer,
                     tracker: ChoiceTracker) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams as they arrive, as (prompt index, output) in the tracker's view; an error ends
        the response.

        Outputs are cumulative, so only the newest unread one per prompt is kept: a slow client
        costs no memory, it just receives bigger deltas.
        """
        if len(streams) == 1:
            # One prompt (every chat request, most completions): read it directly, with no pump task and
            # no event between the engine's output and the response, per token.
            try:
                async for output in streams[0]:
                    output = tracker.view(output)
                    yield 0, output
                    _observe(timer, tracker, output)
            finally:
                streams[0].cancel()
            return
        newest: dict[int, RequestOutput] = {}
        failures: list[BaseException] = []
        ended: set[int] = set()
        wake = asyncio.Event()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    newest[index] = tracker.view(output)
                    wake.set()
            except Exception as exc:
                failures.append(exc)
            finally:
                ended.add(index)
                wake.set()

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            while newest or len(ended) < len(streams):
                await wake.wait()
                wake.clear()
                if failures:
                    raise failures[0]
                batch = sorted(newest.items())
                newest.clear()
                for index, output in batch:
                    yield index, output
                    _observe(timer, tracker, output)
            if failures:
                raise failures[0]
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.cancel()

    def chat_prompt(self, request: ChatCompletionRequest | TokenizeRequest, messages: list[Any],
                    continue_final: bool = False) -> list[int]:
        turns = template_messages(chat_template_messages(messages))
        kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
        if continue_final:
            kwargs["continue_final_message"] = True
        if getattr(request, "tools", None):
            kwargs["tools"] = request.tools
        try:
            return apply_chat_template(self.tokenizer, turns, request.add_generation_prompt, **kwargs)
        except ValueError as exc:
            raise ProtocolError(f"cannot apply the chat template: {exc}", param="messages") from exc
        except Exception as exc:  # jinja template errors (e.g. a template that rejects a role order)
            raise ProtocolError(f"the chat template failed on these messages: {exc}", param="messages") from exc

    # ---- /v1/completions ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        timer = RequestTimer(self.metrics)
        body = await self.parse(request, CompletionRequest)
        self.check_model(body.model)
        body.check_unsupported()
        prompts = body.prompts()
        # Echoed prompts come with their tokens' logprobs when logprobs are asked for (OpenAI's legacy API;
        # scoring harnesses read them).
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        params = body.sampling_params(body.engine_max_tokens(), body.logprobs, max(wanted) if wanted else None)
        request_id = new_id("cmpl")
        extras = self.trace_extras(body)
        extraction = self.extraction_request(body)
        streams = await self.add_all(prompts, params, request_id, param="prompt", extras=extras)
        echo = [self._prompt_text(p) if body.echo else "" for p in prompts]
        tracker = ChoiceTracker(n=body.n, echo_only=body.echo_only())
        if body.stream:
            return EventStream(self._completion_events(body, request_id, streams, tracker, timer, echo))
        final_outputs: dict[int, RequestOutput] = {}
        finals = await until_disconnect(request, self._collect(streams, tracker, timer, final_outputs))
        choices = []
        for index in sorted(tracker.finals):
            completion = finals[index]
            prefix = echo[index // body.n]
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(completion, 0, body.logprobs, len(prefix))
                if body.echo:
                    logprobs = echo_logprobs(final_outputs[index // body.n], body.logprobs, logprobs,
                                             self.tokenizer.decode)
            choices.append(CompletionChoice(
                index=index, text=prefix + completion.text, logprobs=logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                prompt_logprobs=(prompt_logprobs(final_outputs[index // body.n], body.prompt_logprobs)
                                 if body.prompt_logprobs is not None else None)))
        response = with_saves(CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                                 usage=tracker.usage()).model_dump(), final_outputs)
        if extraction is not None:
            await until_disconnect(request, self.add_hidden_states(extraction, request_id, response,
                                                                   final_outputs, body.n))
        return JSONResponse(response)

    # ---- hidden-state extraction (pellucid/extraction/http.py) -----------------------------------
    def extraction_request(self, body: CompletionRequest) -> ExtractionRequest | None:
        try:
            return self.extraction.parse(body.extract_hidden_states, body.stream, body.interventions is not None)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="extract_hidden_states") from exc

    async def add_hidden_states(self, extraction: ExtractionRequest, request_id: str, response: dict[str, Any],
                                final_outputs: dict[int, RequestOutput], n: int) -> None:
        """Run the extraction pass for every choice and add its `hidden_states` field."""
        for choice in response["choices"]:
            output = final_outputs[choice["index"] // n]
            completion = output.outputs[choice["index"] % n]
            try:
                choice["hidden_states"] = await self.extraction.extract(
                    extraction, output.prompt_token_ids, completion.token_ids, f"{request_id}-{choice['index']}")
            except ValueError as exc:
                raise ProtocolError(str(exc), param="extract_hidden_states") from exc
    # ---- hidden-state extraction (end) -----------------------------------------------------------

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def _collect(self, streams: list[RequestStream], tracker: ChoiceTracker, timer: RequestTimer,
                       final_outputs: dict[int, RequestOutput] | None = None) -> dict[int, Any]:
        async with contextlib.aclosing(self.merged(streams, timer, tracker)) as outputs:
            async for index, output in outputs:
                tracker.update(index, output)
                if final_outputs is not None and output.finished:
                    final_outputs[index] = output
        return tracker.finals

    def _completion_events(self, body: CompletionRequest, request_id: str, streams: list[RequestStream],
                           tracker: ChoiceTracker, timer: RequestTimer, echo: list[str]) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice]) -> CompletionResponse:
            return CompletionResponse(id=request_id, model=self.model_name, choices=choices)

        # An echoed prompt opens the stream, or, when its logprobs are asked for (known once the engine has
        # run the prompt), opens each choice's first chunk.
        echo_first = body.echo and body.logprobs is not None

        # Each choice's next text_offset, counted as the non-streamed response counts it (the lengths of the
        # tokens' own texts), not from the text sent so far, which lags where a token's bytes end mid-character.
        next_offset: dict[int, int] = {}

        def choice(delta: Delta) -> CompletionChoice:
            prefix = echo[delta.index // body.n]
            text, logprobs = delta.text, None
            if body.logprobs is not None:
                start = next_offset.get(delta.index, len(prefix))
                logprobs = completion_logprobs(delta.output, delta.token_start, body.logprobs, start)
                next_offset[delta.index] = start + sum(map(len, logprobs.tokens))
            if echo_first and delta.text_start == 0 and delta.token_start == 0:
                text = prefix + text
                assert logprobs is not None
                logprobs = echo_logprobs(delta.request, body.logprobs, logprobs, self.tokenizer.decode)
            return CompletionChoice(index=delta.index, text=text, logprobs=logprobs, finish_reason=delta.finish_reason,
                                    stop_reason=delta.output.stop_reason if delta.finish_reason else None)

        opening = []
        if body.echo and not echo_first:
            opening = [chunk([CompletionChoice(index=i * body.n + j, text=echo[i])
                              for i in range(len(streams)) for j in range(body.n)])]
        return self._event_stream(opening, chunk, choice, body.include_usage_in_stream, streams, tracker, timer)

    async def _event_stream(self, opening: list[BaseModel], chunk: Callable[[list[Any]], BaseModel],
                            choice: Callable[[Delta], Any], include_usage: bool, streams: list[RequestStream],
                            tracker: ChoiceTracker, timer: RequestTimer) -> AsyncIterator[str]:
        """The SSE body of both streaming endpoints: the `opening` chunks, one chunk per engine output that
        changed any choice (`choice` builds each from its delta), the usage chunk when asked for, [DONE]."""
        try:
            for first in opening:
                yield sse_event(first)
            async with contextlib.aclosing(self.merged(streams, timer, tracker)) as outputs:
                async for index, output in outputs:
                    choices = [c for c in map(choice, tracker.update(index, output)) if c is not None]
                    if not choices:
                        continue
                    if output.finished and output.extras.get("saves") is not None:
                        # A traced request's saves ride on its last chunk (interventions need n=1, so the
                        # choice index is the prompt index).
                        yield sse_event(with_saves(chunk(choices).model_dump(), {index: output}))
                    else:
                        yield sse_event(chunk(choices))
            if include_usage:
                final = chunk([])
                final.usage = tracker.usage()
                yield sse_event(final)
        except Exception as exc:
            yield sse_event(error_response_body(self._stream_error(exc)))
        yield "data: [DONE]\n\n"

    def _stream_error(self, exc: Exception) -> ProtocolError:
        """An error after the stream started goes into the stream, since the status line is already sent."""
        self.metrics.request_failed()
        if isinstance(exc, EngineDeadError):
            return ProtocolError(str(exc), status=503, error_type="service_unavailable")
        if not isinstance(exc, RequestFailedError):
            logger.exception("streaming response failed")
        elif exc.bad_request:
            return ProtocolError(str(exc))
        return _internal_error(str(exc))

    # ---- /v1/chat/completions ---------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        timer = RequestTimer(self.metrics)
        body = await self.parse(request, ChatCompletionRequest)
        self.check_model(body.model)
        body.check_unsupported()
        body.check_text_only()
        tools = plan_tools(body.tools, body.tool_choice, self.tool_call_parser, self.enable_auto_tool_choice,
                           body.parallel_tool_calls)
        prompt_ids = self.chat_prompt(body, body.messages, body.continue_final_message)
        top_logprobs = body.num_logprobs()
        params = body.sampling_params(body.effective_max_tokens(), top_logprobs, body.prompt_logprobs)
        if tools is not None:
            params = with_tools(params, tools)
        request_id = new_id("chatcmpl")
        extras = self.trace_extras(body)
        streams = await self.add_all([prompt_ids], params, request_id, param="messages", extras=extras)
        tracker = ChoiceTracker(n=body.n)
        if body.stream:
            return EventStream(self._chat_events(body, request_id, streams, tracker, timer, top_logprobs, tools))
        final_outputs: dict[int, RequestOutput] = {}
        finals = await until_disconnect(request, self._collect(streams, tracker, timer, final_outputs))
        choices = []
        for index in sorted(finals):
            final = finals[index]
            answer = final_answer(final.text, final.finish_reason, tools, self.reasoning_parser)
            choices.append(ChatChoice(
                index=index, message=ChatResponseMessage(content=answer.content, reasoning=answer.reasoning,
                                                         tool_calls=answer.tool_calls),
                logprobs=chat_logprobs(final, 0, top_logprobs) if top_logprobs is not None else None,
                finish_reason=answer.finish_reason, stop_reason=final.stop_reason))
        scored = (prompt_logprobs(final_outputs[0], body.prompt_logprobs) if body.prompt_logprobs is not None
                  else None)
        response = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices, usage=tracker.usage(),
                                          prompt_logprobs=scored)
        return JSONResponse(with_saves(response.model_dump(), final_outputs))

    def _chat_events(self, body: ChatCompletionRequest, request_id: str, streams: list[RequestStream],
                     tracker: ChoiceTracker, timer: RequestTimer, top_logprobs: int | None,
                     tools: ToolPlan | None) -> AsyncIterator[str]:
        def chunk(choices: list[ChatStreamChoice]) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=request_id, model=self.model_name, choices=choices)

        answers = {i: ChatAnswerStream(tools, self.reasoning_parser) for i in range(body.n)}

        def choice(delta: Delta) -> ChatStreamChoice | None:
            reasoning, content, calls, finish = answers[delta.index].feed(delta.output.text, delta.finish_reason)
            if reasoning is None and content is None and not calls and finish is None and top_logprobs is None:
                return None     # held back: it may begin a tag (a tool call, the end of the reasoning)
            return ChatStreamChoice(
                index=delta.index, delta=DeltaMessage(content=content, reasoning=reasoning, tool_calls=calls or None),
                logprobs=(chat_logprobs(delta.output, delta.token_start, top_logprobs)
                          if top_logprobs is not None else None),
                finish_reason=finish, stop_reason=delta.output.stop_reason if delta.finish_reason else None)

        opening = [chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                          for i in range(body.n)])]
        return self._event_stream(opening, chunk, choice, body.include_usage_in_stream, streams, tracker, timer)

    # ---- small endpoints ------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        body = await self.parse(request, TokenizeRequest)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ProtocolError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = self.chat_prompt(body, body.messages)
            if body.add_special_tokens:
                raise ProtocolError("add_special_tokens is not supported with messages (the chat template "
                                    "decides the special tokens)", param="add_special_tokens")
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = list(self.tokenizer(body.prompt, add_special_tokens=add_special)["input_ids"])
        return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=self.llm.max_model_len,
                                             tokens=tokens).model_dump())

    async def detokenize(self, request: Request) -> Response:
        body = await self.parse(request, DetokenizeRequest)
        self.check_model(body.model)
        vocab = len(self.tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ProtocolError(f"tokens out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return JSONResponse(DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens)).model_dump())

    async def models(self) -> Response:
        card = ModelCard(id=self.model_name, root=self.llm.config.model.model, max_model_len=self.llm.max_model_len)
        listing = ModelList(data=[card]).model_dump()
        listing["data"][0]["pellucid"] = {"lm_head": self.lm_head}   # which head serves this model
        return JSONResponse(listing)

    async def metrics_text(self) -> Response:
        stats = self.llm.get_stats()
        self.metrics.update_from_stats(stats)
        self.metrics.update_lm_head_usage(stats.lm_head_usage)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _guarded(server: OpenAIServer, handler: Callable[[Request], Awaitable[Response]]) -> Callable[..., Any]:
    """Map every failure of one request to its OpenAI error response; nothing escapes to the server."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except ProtocolError as exc:
            return error_response(exc)
        except ClientDisconnected:
            logger.info("client disconnected from %s; its requests were aborted", request.url.path)
            return Response(status_code=499)
        except EngineDeadError as exc:
            server.metrics.request_failed()
            return error_response(ProtocolError(str(exc), status=503, error_type="service_unavailable"))
        except RequestFailedError as exc:
            server.metrics.request_failed()
            if exc.bad_request:     # its own constraints contradict each other: retrying cannot help
                return error_response(ProtocolError(str(exc)))
            return error_response(_internal_error(str(exc)))
        except Exception as exc:
            server.metrics.request_failed()
            logger.exception("request to %s failed", request.url.path)
            return error_response(_internal_error(f"internal error: {type(exc).__name__}: {exc}"))
    return endpoint


def build_app(async_llm: AsyncLLM, served_model_name: str, api_key: str | None = None,
              log_stats_interval: float | None = None, extract_dir: str | None = None,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None, pooler_config: dict[str, Any] | str | None = None,
              responses_store_size: int = 0) -> FastAPI:
    """The app; `log_stats_interval` > 0 logs a stats line that often while the app runs; `extract_dir` is
    where `extract_hidden_states` with output "server" writes (None: inline only); `tool_call_parser` names
    the parser of tool_choice "auto", which `enable_auto_tool_choice` allows; `reasoning_parser` splits a
    thinking model's reasoning from its answer; `pooler_config` (vLLM's --pooler-config) overrides how
    /v1/embeddings pools (pellucid/pooling/config.py); `responses_store_size` how many /v1/responses results
    the server keeps for retrieval, `previous_response_id` and background responses (0: none)."""
    PoolerConfig().overridden(pooler_config)       # a bad override fails at start-up
    server = OpenAIServer(async_llm, served_model_name, extract_dir, tool_call_parser, enable_auto_tool_choice,
                          reasoning_parser, pooler_config, responses_store_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = None
        if log_stats_interval and log_stats_interval > 0:
            task = asyncio.create_task(log_stats_periodically(async_llm.get_stats, server.metrics,
                                                              log_stats_interval))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await server.responses.close()
            await server.extraction.close()

    app = FastAPI(title="Pellucid OpenAI-compatible server", version=pellucid.__version__, lifespan=lifespan)
    app.state.openai_server = server

    protected = protected_router(app, api_key)
    protected.add_api_route("/v1/completions", _guarded(server, server.completions), methods=["POST"])
    protected.add_api_route("/v1/chat/completions", _guarded(server, server.chat_completions), methods=["POST"])
    protected.add_api_route("/v1/responses", _guarded(server, server.responses.create), methods=["POST"])
    protected.add_api_route("/v1/responses/{response_id}", _guarded(server, server.responses.retrieve),
                            methods=["GET"])
    protected.add_api_route("/v1/responses/{response_id}/cancel", _guarded(server, server.responses.cancel),
                            methods=["POST"])
    protected.add_api_route("/v1/responses/{response_id}/input_items",
                            _guarded(server, server.responses.input_items), methods=["GET"])
    protected.add_api_route("/v1/responses/{response_id}", _guarded(server, server.responses.delete),
                            methods=["DELETE"])
    protected.add_api_route("/v1/embeddings", _guarded(server, server.embeddings.create), methods=["POST"])
    protected.add_api_route("/classify", _guarded(server, server.classifications.create), methods=["POST"])
    for path in ("/score", "/v1/score"):          # vLLM's paths
        protected.add_api_route(path, _guarded(server, server.scores.score), methods=["POST"])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        protected.add_api_route(path, _guarded(server, server.scores.rerank), methods=["POST"])
    protected.add_api_route("/tokenize", _guarded(server, server.tokenize), methods=["POST"])
    protected.add_api_route("/detokenize", _guarded(server, server.detokenize), methods=["POST"])
    protected.add_api_route("/v1/models", _guarded(server, lambda _request: server.models()), methods=["GET"])
    app.include_router(protected)
    add_service_routes(app, lambda: async_llm.is_running, server.metrics_text)
    return app


def protected_router(app: FastAPI, api_key: str | None) -> APIRouter:
    """A router whose routes need `Authorization: Bearer <api_key>` (none when api_key is None); the app
    answers a ProtocolError with its OpenAI error body (the key check runs as a dependency: a 401, not a 500)."""
    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise ProtocolError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                status=401, error_type="authentication_error", code="invalid_api_key")

    async def protocol_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ProtocolError)
        return error_response(exc)

    app.add_exception_handler(ProtocolError, protocol_error)
    return APIRouter(dependencies=[Depends(require_key)])


def add_service_routes(app: FastAPI, is_running: Callable[[], bool],
                       metrics_text: Callable[[], Awaitable[Response]]) -> None:
    """`/health` (200 while the engine runs, else 503), `/version` and `/metrics`: every server has them."""
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if is_running() else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pellucid.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return await metrics_text()
