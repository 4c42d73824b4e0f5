"""AsyncOmni: the Qwen3-Omni pipeline for asyncio code (the server).

Each stage's engine runs by itself (its own process by default, chunks through shared memory; or a thread
of this process with in-process connectors, `engine_process=False`). One task per stage takes that
engine's reports and hands them to the Pipeline, which relays chunk notices and feeds each request's
stream of OmniRequestOutputs. A reader that goes away (cancels) aborts its request in every stage.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Callable

from pellucid.engine.async_llm import RequestFailedError, RequestStream
from pellucid.logger import get_logger
from pellucid.pipeline.graph import PipelineGraph, qwen3_omni_graph
from pellucid.pipeline.pipeline import OmniRequestOutput, Pipeline
from pellucid.pipeline.qwen3_omni import AudioRequest
from pellucid.sampling_params import SamplingParams

logger = get_logger(__name__)


class AsyncOmni:
    def __init__(self, model: str, graph: PipelineGraph | None = None, *, engine_process: bool = True,
                 chunk_size: int | str | None = None, served_model_name: str | None = None,
                 **engine_kwargs: Any) -> None:
        graph = graph or qwen3_omni_graph()
        if chunk_size is not None:
            graph = graph.with_chunk_size(chunk_size)
        graph = graph.with_connector("shm" if engine_process else "inproc")
        self.pipeline = Pipeline(model, graph, engine_process=engine_process, asynchronous=True, **engine_kwargs)
        self.model = model
        self.model_name = served_model_name or model
        self.tokenizer = self.pipeline.tokenizer
        self.info = self.pipeline.clients[self.pipeline.first].info
        self.max_model_len = self.info.max_model_len
        self._streams: dict[str, RequestStream] = {}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_callbacks: list[Callable[[str], None]] = []

    @property
    def is_running(self) -> bool:
        return self.pipeline.dead is None

    def on_engine_dead(self, callback: Callable[[str], None]) -> None:
        self._dead_callbacks.append(callback)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          audio: AudioRequest | None = AudioRequest(), extras: dict[str, Any] | None = None
                          ) -> RequestStream:
        """Queue a request in every stage it needs; ValueError for a bad one (nothing queued)."""
        self._ensure_tasks()
        if self.pipeline.dead is not None:
            raise RuntimeError(self.pipeline.dead)
        # Every output: each carries audio of its own (text is cumulative).
        stream = RequestStream(request_id, self, skip_to_newest=False)
        self.pipeline.add_request(request_id, prompt, params, audio, extras)
        self._streams[request_id] = stream
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       audio: AudioRequest | None = AudioRequest()) -> AsyncIterator[OmniRequestOutput]:
        stream = await self.add_request(request_id, prompt, params, audio)
        try:
            async for output in stream:
                yield output
        finally:
            stream.cancel()

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if self._loop is not None and self._loop.is_running():
            try:
                if asyncio.get_running_loop() is self._loop:
                    self.pipeline.abort_request(request_id)
                    return
            except RuntimeError:
                pass
            self._loop.call_soon_threadsafe(self.pipeline.abort_request, request_id)
        else:
            self.pipeline.abort_request(request_id)

    def stats(self) -> dict[str, Any]:
        return self.pipeline.stats()

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.pipeline.shutdown()

    # ---- the stages' reports -----------------------------------------------------------------------
    def _ensure_tasks(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._tasks:
            return
        self._loop = loop
        self._tasks = [loop.create_task(self._read(stage, client), name=f"pellucid-omni-{stage}")
                       for stage, client in self.pipeline.clients.items()]

    async def _read(self, stage: str, client: Any) -> None:
        while True:
            outputs = await client.get_outputs_async()
            engine_error = outputs.engine_error
            self._deliver(stage, outputs)
            # Not kept while waiting for the next report (a stage may send none for long): the final outputs
            # must be the only owners of what they carry (saves).
            del outputs
            if engine_error is not None:
                for callback in self._dead_callbacks:
                    callback(self.pipeline.dead or engine_error)
                return

    def _deliver(self, stage: str, outputs: Any) -> None:
        try:
            reports = self.pipeline.process(stage, outputs)
        except Exception:
            logger.exception("the pipeline could not process the %s stage's outputs", stage)
            return
        for report in reports:
            stream = self._streams.get(report.request_id)
            if stream is None:
                continue
            if report.finished:
                del self._streams[report.request_id]
                if report.error is not None and not (report.text and report.text.outputs):
                    stream.put(RequestFailedError(report.request_id, report.error))
                    continue
            stream.put(report)
