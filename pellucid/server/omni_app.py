"""The OpenAI-compatible app over a speech pipeline (AsyncOmni, Qwen3-Omni): `/v1/chat/completions` with
text and audio output as OpenAI's audio API returns them, `/v1/models`, `/health`, `/version`, `/metrics`.

With `modalities: ["text", "audio"]` and `audio: {"voice": ..., "format": "wav" | "pcm16"}` the answer's
message has `content: null` and `audio: {id, data (base64), expires_at, transcript}`; streamed, each chunk's
`delta.audio` carries `transcript` text or `data` (base64 16-bit PCM, 24 kHz mono; for "wav" the first
data chunk starts with a WAV header of unknown length, so the concatenated data is one WAV stream), and
the last one `expires_at`. Without audio the thinker alone answers, as any chat model. Tracing
(`interventions`) runs on the thinker, at its HF paths (`thinker.model.layers.3.output`).
"""
from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import pellucid
from pellucid.engine.async_llm import RequestFailedError, RequestStream
from pellucid.engine.input_processor import ExtrasError
from pellucid.logger import get_logger
from pellucid.pipeline.async_omni import AsyncOmni
from pellucid.pipeline.pipeline import OmniRequestOutput
from pellucid.pipeline.qwen3_omni import AudioRequest
from pellucid.server.app import (add_service_routes, error_response, sse_event,
                                 error_response_body, protected_router)
from pellucid.server.audio import FORMATS, pcm16, wav, wav_header
from pellucid.server.disconnect import ClientDisconnected, EventStream, until_disconnect
from pellucid.server.protocol import (ChatCompletionRequest, ModelCard, ModelList, ProtocolError, UsageInfo,
                                      chat_template_messages, new_id, parse_request, sampling_field_of)
from pellucid.tokenizer import apply_chat_template
from pellucid.tracing.http import trace_extras, with_saves

logger = get_logger(__name__)

AUDIO_EXPIRY_SECONDS = 3600
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


class OmniMetrics:
    """Per-stage gauges (from each engine's stats at scrape time) and per-request latencies."""

    def __init__(self, model_name: str, stages: list[str]) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}

        def stage_gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name", "stage"], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(**label)

        self.label = label
        self.stages = stages
        self.running = stage_gauge("pellucid:stage_num_requests_running", "Requests running in a stage")
        self.waiting = stage_gauge("pellucid:stage_num_requests_waiting",
                                   "Requests waiting in a stage (not scheduled, or waiting for the previous stage)")
        self.kv_usage = stage_gauge("pellucid:stage_kv_cache_usage_perc", "Fraction of a stage's KV blocks in use")
        self.steps = stage_gauge("pellucid:stage_engine_steps", "Steps a stage's engine ran")
        self.step_seconds = stage_gauge("pellucid:stage_engine_step_seconds", "Time a stage's engine spent in steps")
        self.stage_first = Histogram("pellucid:stage_time_to_first_output_seconds",
                                     "From arrival to a stage's first output for the request (its TTFT)",
                                     ["model_name", "stage"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.ttft = histogram("pellucid:time_to_first_token_seconds", "Time to the first text token",
                              _LATENCY_BUCKETS)
        self.ttfp = histogram("pellucid:time_to_first_audio_seconds", "Time to the first audio packet (TTFP)",
                              _LATENCY_BUCKETS)
        self.rtf = histogram("pellucid:real_time_factor", "Request latency / audio duration", _RTF_BUCKETS)
        self.e2e = histogram("pellucid:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             _LATENCY_BUCKETS)
        self.audio_seconds = Counter("pellucid:audio_seconds", "Seconds of audio generated", ["model_name"],
                                     registry=self.registry).labels(**label)
        self.success = Counter("pellucid:request_success", "Requests finished", ["model_name"],
                               registry=self.registry).labels(**label)
        self.failure = Counter("pellucid:request_failure", "Requests that ended with an error", ["model_name"],
                               registry=self.registry).labels(**label)

    def update_from_stats(self, stats: dict[str, Any]) -> None:
        for stage, s in stats.items():
            if s is None:
                continue
            labels = {**self.label, "stage": stage}
            self.running.labels(**labels).set(s.num_running)
            self.waiting.labels(**labels).set(s.num_waiting)
            self.kv_usage.labels(**labels).set(s.kv_cache_usage)
            self.steps.labels(**labels).set(s.num_steps)
            self.step_seconds.labels(**labels).set(s.step_seconds)

    def request_done(self, output: OmniRequestOutput) -> None:
        m = output.metrics
        (self.failure if output.error else self.success).inc()
        for key, metric in (("time_to_first_token", self.ttft), ("time_to_first_audio", self.ttfp),
                            ("real_time_factor", self.rtf), ("latency", self.e2e)):
            if key in m:
                metric.observe(m[key])
        for stage in self.stages:
            if f"{stage}_first_output" in m:
                self.stage_first.labels(**self.label, stage=stage).observe(m[f"{stage}_first_output"])
        self.audio_seconds.inc(m.get("audio_seconds", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class OmniServer:
    def __init__(self, omni: AsyncOmni, served_model_name: str) -> None:
        self.omni = omni
        self.model_name = served_model_name
        self.metrics = OmniMetrics(served_model_name, list(omni.pipeline.graph.order))
        self.ignored_fields: set[str] = set()    # request fields this server does not know, warned about once each

    async def parse(self, request: Request) -> ChatCompletionRequest:
        return parse_request(await request.body(), ChatCompletionRequest, self.ignored_fields)

    # ---- /v1/chat/completions ---------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse(request)
        if body.model is not None and body.model != self.model_name:
            raise ProtocolError(f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                                param="model", status=404, code="model_not_found")
        body.check_unsupported()
        audio, audio_format = self._audio(body)
        if body.n != 1:
            raise ProtocolError("this server answers one choice per request (n=1)", param="n")
        if body.logprobs:
            raise ProtocolError("logprobs are not served by the speech pipeline", param="logprobs")
        if body.prompt_logprobs is not None:
            raise ProtocolError("prompt_logprobs are not served by the speech pipeline", param="prompt_logprobs")
        if body.tools:
            raise ProtocolError("tools are not served by the speech pipeline", param="tools")
        if body.structured_outputs_params() is not None:
            raise ProtocolError("structured outputs are not served by the speech pipeline", param="response_format")
        try:
            prompt_ids = apply_chat_template(self.omni.tokenizer, chat_template_messages(body.messages),
                                             body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        except Exception as exc:
            raise ProtocolError(f"cannot apply the chat template: {exc}", param="messages") from exc
        params = body.sampling_params(body.effective_max_tokens(), None)
        try:
            extras = trace_extras(body.interventions, body.n)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="interventions") from exc
        request_id = new_id("chatcmpl")
        try:
            stream = await self.omni.add_request(request_id, prompt_ids, params, audio, extras)
        except ExtrasError as exc:
            raise ProtocolError(str(exc), param="interventions") from exc
        except ValueError as exc:
            raise ProtocolError(str(exc), param=sampling_field_of(exc, "messages")) from exc
        if body.stream:
            return EventStream(self._events(body, request_id, stream, audio_format))
        final, samples = await until_disconnect(request, self._collect(stream))
        return JSONResponse(self._response(body, request_id, final, samples, audio_format))

    def _audio(self, body: ChatCompletionRequest) -> tuple[AudioRequest | None, str | None]:
        if not body.wants_audio():
            return None, None
        settings = body.audio or {}
        audio_format = settings.get("format", "wav")
        if audio_format not in FORMATS:
            raise ProtocolError(f"audio format {audio_format!r} is not supported; use one of {', '.join(FORMATS)}",
                                param="audio")
        voice = settings.get("voice")
        if not isinstance(voice, str):
            raise ProtocolError("audio.voice must name one of this model's voices", param="audio")
        try:
            self.omni.pipeline.requests_builder.check_voice(voice)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="audio") from exc
        return AudioRequest(voice), audio_format

    async def _collect(self, stream: RequestStream) -> tuple[OmniRequestOutput, list[Any]]:
        samples: list[Any] = []
        final = None
        try:
            async for output in stream:
                if len(output.audio):
                    samples.append(output.audio)
                final = output
        except RequestFailedError as exc:
            self.metrics.failure.inc()
            raise ProtocolError(exc.message, status=500, error_type="internal_server_error") from exc
        assert final is not None
        self.metrics.request_done(final)
        return final, samples

    def _response(self, body: ChatCompletionRequest, request_id: str, final: OmniRequestOutput, samples: list[Any],
                  audio_format: str | None) -> dict[str, Any]:
        import torch
        completion = final.text.outputs[0] if final.text and final.text.outputs else None
        text = completion.text if completion else ""
        if final.error is not None:
            raise ProtocolError(final.error, status=500, error_type="internal_server_error")
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if audio_format is not None:
            waveform = torch.cat(samples) if samples else torch.zeros(0)
            data = wav(waveform, final.sample_rate) if audio_format == "wav" else pcm16(waveform)
            message = {"role": "assistant", "content": None,
                       "audio": {"id": f"audio_{request_id}", "data": base64.b64encode(data).decode("ascii"),
                                 "expires_at": int(time.time()) + AUDIO_EXPIRY_SECONDS, "transcript": text}}
        num_prompt = len(final.text.prompt_token_ids) if final.text else 0
        num_completion = len(completion.token_ids) if completion else 0
        response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name,
                    "choices": [{"index": 0, "message": message,
                                 "finish_reason": completion.finish_reason if completion else None}],
                    "usage": UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                                       total_tokens=num_prompt + num_completion).model_dump()}
        return with_saves(response, {0: final.text}) if final.text is not None else response

    async def _events(self, body: ChatCompletionRequest, request_id: str, stream: RequestStream,
                      audio_format: str | None) -> AsyncIterator[str]:
        def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
            return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": self.model_name, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

        audio_id = f"audio_{request_id}"
        sent_text = 0
        header_sent = False
        final = None
        try:
            yield sse_event(chunk({"role": "assistant", "content": "" if audio_format is None else None}))
            async for output in stream:
                final = output
                completion = output.text.outputs[0] if output.text and output.text.outputs else None
                text = completion.text if completion else ""
                if len(text) > sent_text:
                    piece, sent_text = text[sent_text:], len(text)
                    delta = {"content": piece} if audio_format is None else {"audio": {"id": audio_id,
                                                                                       "transcript": piece}}
                    yield sse_event(chunk(delta))
                if audio_format is not None and len(output.audio):
                    data = pcm16(output.audio)
                    if audio_format == "wav" and not header_sent:
                        data = wav_header(output.sample_rate, None) + data
                        header_sent = True
                    yield sse_event(chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}}))
                if output.finished:
                    if output.error is not None:
                        raise RequestFailedError(request_id, output.error)
                    last = {"audio": {"id": audio_id, "expires_at": int(time.time()) + AUDIO_EXPIRY_SECONDS}} \
                        if audio_format is not None else {}
                    yield sse_event(chunk(last, completion.finish_reason if completion else "stop"))
            if final is not None:
                self.metrics.request_done(final)
        except Exception as exc:
            if final is not None and final.finished:
                self.metrics.request_done(final)
            else:
                self.metrics.failure.inc()
            message = exc.message if isinstance(exc, RequestFailedError) else f"{type(exc).__name__}: {exc}"
            yield sse_event(error_response_body(ProtocolError(message, status=500, error_type="internal_server_error")))
        finally:
            stream.cancel()
        yield "data: [DONE]\n\n"

    # ---- small endpoints ----------------------------------------------------------------------------
    async def models(self) -> Response:
        card = ModelCard(id=self.model_name, root=self.omni.model, max_model_len=self.omni.max_model_len)
        listing = ModelList(data=[card]).model_dump()
        pipeline = self.omni.pipeline
        listing["data"][0]["pellucid"] = {"pipeline": list(pipeline.graph.order),
                                          "voices": pipeline.omni.speakers, "output_modalities": ["text", "audio"]}
        return JSONResponse(listing)

    async def metrics_text(self) -> Response:
        self.metrics.update_from_stats(self.omni.stats())
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_omni_app(omni: AsyncOmni, served_model_name: str, api_key: str | None = None) -> FastAPI:
    server = OmniServer(omni, served_model_name)
    app = FastAPI(title="Pellucid speech pipeline (OpenAI-compatible)", version=pellucid.__version__)
    app.state.omni_server = server

    async def chat(request: Request) -> Response:
        try:
            return await server.chat_completions(request)
        except ProtocolError as exc:
            return error_response(exc)
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:
            logger.exception("request failed")
            server.metrics.failure.inc()
            return error_response(ProtocolError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                                                error_type="internal_server_error"))

    async def models() -> Response:
        return await server.models()

    protected = protected_router(app, api_key)
    protected.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    protected.add_api_route("/v1/models", models, methods=["GET"])
    app.include_router(protected)
    add_service_routes(app, lambda: omni.is_running, server.metrics_text)
    return app
