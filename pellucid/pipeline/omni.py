"""Offline Qwen3-Omni: text and a waveform per prompt, from a pipeline of three engines.

```python
from pellucid.pipeline.omni import OmniLLM
omni = OmniLLM("Qwen3-Omni-30B-A3B-Instruct", chunk_size=25)
out = omni.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=200), voice="ethan")[0]
out.text, out.audio, out.sample_rate       # str, float32 tensor, 24000
```

By default the three engines run in this process, stepped in turn by `step()`. `stage_threads=True`: each
engine in a thread of this process, stepping by itself; on CUDA each thread queues its kernels on a stream of
its own, so the stages' small decode kernels can run side by side in one CUDA context. `engine_process=True`:
each in its own process, chunks through shared memory; the GPU then time-slices between the processes'
contexts (docs/pipelines.md). `chunk_size` is the pipeline's chunk size on both edges ("all":
stage after stage); `graph` declares the pipeline in full (pellucid.pipeline.graph). OmniLLM also steps
like LLM: add_request / step / has_unfinished_requests / abort_request.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pellucid.pipeline.graph import PipelineGraph, qwen3_omni_graph
from pellucid.pipeline.pipeline import OmniRequestOutput, Pipeline
from pellucid.pipeline.qwen3_omni import AudioRequest
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import apply_chat_template


@dataclass
class OmniOutput:
    """A finished request: its text and its whole waveform."""

    request_id: str
    text: str
    token_ids: list[int]
    audio: torch.Tensor             # float32 samples in [-1, 1]
    sample_rate: int
    finish_reason: str | None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    stage_token_ids: dict[str, list[int]] = field(default_factory=dict)    # e.g. the talker's first codes


class OmniLLM:
    def __init__(self, model: str, graph: PipelineGraph | None = None, *, chunk_size: int | str | None = None,
                 connector: str | None = None, engine_process: bool = False, stage_threads: bool = False,
                 **engine_kwargs: Any) -> None:
        if engine_process and stage_threads:
            raise ValueError("engine_process=True and stage_threads=True exclude each other: a stage's engine runs "
                             "either in its own process or in a thread of this one")
        graph = graph or qwen3_omni_graph()
        if chunk_size is not None:
            graph = graph.with_chunk_size(chunk_size)
        if connector is not None or engine_process:
            graph = graph.with_connector(connector or "shm")
        self.pipeline = Pipeline(model, graph, engine_process=engine_process, asynchronous=stage_threads,
                                 **engine_kwargs)
        self.tokenizer = self.pipeline.tokenizer
        self._counter = 0
        self._audio: dict[str, list[torch.Tensor]] = {}
        self._outputs: queue.Queue[tuple[str, Any]] | None = None
        if engine_process or stage_threads:
            # One reader per stage's engine (process or thread), all into one queue that step() takes from.
            self._outputs = queue.Queue()
            self._readers = [threading.Thread(target=self._read, args=(stage, client), daemon=True,
                                              name=f"pellucid-omni-{stage}")
                             for stage, client in self.pipeline.clients.items()]
            self._closing = False
            for reader in self._readers:
                reader.start()

    # ---- offline ----------------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | Sequence[str | list[int]], params: SamplingParams | None = None,
                 voice: str | None = "ethan", talker_params: SamplingParams | None = None) -> list[OmniOutput]:
        """Text and audio for each prompt (a chat-formatted string or token ids); voice=None: text only."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]     # type: ignore[list-item]
        params = params or SamplingParams()
        audio = AudioRequest(voice, talker_params) if voice is not None else None
        ids = []
        for prompt in prompts:
            request_id = f"omni-{self._counter}"
            self._counter += 1
            self.add_request(request_id, prompt, params, audio)
            ids.append(request_id)
        done: dict[str, OmniOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.request_id in ids:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], params: SamplingParams | None = None,
             voice: str | None = "ethan", talker_params: SamplingParams | None = None) -> list[OmniOutput]:
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, conv, True) for conv in conversations]
        return self.generate(prompts, params, voice, talker_params)

    # ---- step by step -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    audio: AudioRequest | None = AudioRequest(), extras: dict[str, Any] | None = None) -> None:
        self.pipeline.add_request(request_id, prompt, params, audio, extras)
        self._audio[request_id] = []

    def abort_request(self, request_id: str) -> None:
        self.pipeline.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.pipeline.has_unfinished_requests()

    def step(self) -> list[OmniOutput]:
        """Advance the pipeline; the requests that finished meanwhile, with all their audio."""
        if self._outputs is None:
            reports = self.pipeline.step()
        else:
            reports = []
            stage, outputs = self._outputs.get()
            while True:
                reports += self.pipeline.process(stage, outputs)
                try:
                    stage, outputs = self._outputs.get_nowait()
                except queue.Empty:
                    break
            self.pipeline.flush_deliveries()
        return [final for final in map(self._take, reports) if final is not None]

    def _take(self, report: OmniRequestOutput) -> OmniOutput | None:
        chunks = self._audio.setdefault(report.request_id, [])
        if len(report.audio):
            chunks.append(report.audio)
        if not report.finished:
            return None
        del self._audio[report.request_id]
        text = report.text.outputs[0] if report.text is not None and report.text.outputs else None
        return OmniOutput(report.request_id, text.text if text else "", list(text.token_ids) if text else [],
                          torch.cat(chunks) if chunks else torch.zeros(0), report.sample_rate,
                          text.finish_reason if text else None, report.error, report.metrics,
                          report.stage_token_ids)

    def _read(self, stage: str, client: Any) -> None:
        while not self._closing:
            outputs = client.get_outputs(timeout=0.5)
            if outputs.outputs or outputs.engine_error is not None:
                assert self._outputs is not None
                self._outputs.put((stage, outputs))
            if outputs.engine_error is not None:
                return

    def stats(self) -> dict[str, Any]:
        return self.pipeline.stats()

    def shutdown(self) -> None:
        self._closing = True
        self.pipeline.shutdown()
        # The readers end within their poll interval once closing; a reader left running while the
        # interpreter exits aborts it ("terminate called without an active exception").
        for reader in getattr(self, "_readers", []):
            if reader is not threading.current_thread():
                reader.join(timeout=5)

    def __enter__(self) -> "OmniLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
