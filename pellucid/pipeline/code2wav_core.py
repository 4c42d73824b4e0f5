"""The engine core of the codec-decoder stage (Qwen3-Omni's code2wav): frames in, audio out.

It speaks the engine core's protocol (EngineCoreLoop, the clients, the engine-core process), with its own
scheduling: there is no KV cache and no sampling. A request's frames arrive in chunks (the stage_input
protocol: the pipeline relays each notice through the utility "stage_input.arrived"); the stream is
decoded in windows of `chunk_size` frames with `left_context` frames before each, exactly as
transformers' `chunked_decode` cuts it (after a shorter first window when `first_chunk_size` is set),
whatever the chunks the frames came in. Each step decodes the
windows that are complete (or the last one, once the stream ended), batching windows of equal length
across requests, and reports each window's samples in the request's output (`events["audio"]`, a float32
tensor). A request finishes once its stream ended and every frame is decoded; one whose chunks are
broken fails alone.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch

import pellucid
from pellucid.config import EngineConfig, resolve_device, resolve_dtype
from pellucid.engine.engine_core import EngineInfo
from pellucid.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineStats
from pellucid.logger import get_logger
from pellucid.models.loader import load_model
from pellucid.models.qwen3_omni.code2wav import window_bounds
from pellucid.pipeline.chunks import ChunkReceiver
from pellucid.pipeline.connectors import ChunkKey, Notice, open_connector
from pellucid.pipeline.stage_features import STAGE_INPUT_KEY, StageInputSpec

logger = get_logger(__name__)


@dataclass(frozen=True)
class DecodeWindows:
    """How a code2wav request's stream is cut for decoding (StageInputSpec.params)."""

    chunk_size: int = 300           # frames per window (transformers' generate uses 300)
    left_context: int = 25          # frames of left context decoded again before each window
    # Frames of the first window, if fewer than chunk_size: the first audio packet waits for these only. The
    # windows after it start at first_chunk_size + i * chunk_size, each with its left context as usual.
    first_chunk_size: int | None = None

    def size_at(self, start: int) -> int:
        """Frames of the window that starts at frame `start`."""
        return self.first_chunk_size if start == 0 and self.first_chunk_size else self.chunk_size


class _Stream:
    def __init__(self, request: EngineCoreRequest, spec: StageInputSpec, windows: DecodeWindows) -> None:
        self.request_id = request.request_id
        self.spec = spec
        self.windows = windows
        self.arrival_time = request.arrival_time
        self.receiver = ChunkReceiver(request.request_id, spec.from_stage, spec.stage)
        self.frames: list[torch.Tensor] = []        # [n, Q] chunks
        self.num_frames = 0
        self.decoded = 0            # frames whose samples were reported
        self.ended = False
        self.audio: list[torch.Tensor] = []         # decoded since the last report
        self.finish_reason: str | None = None
        self.error: str | None = None

    def next_window(self) -> tuple[int, int, int] | None:
        """(first frame fed, end, context) of the next window to decode, or None while it is incomplete."""
        if self.decoded >= self.num_frames:
            return None
        size = self.windows.size_at(self.decoded)
        lo, hi, context = window_bounds(self.decoded, self.num_frames, size, self.windows.left_context)
        if hi - self.decoded < size and not self.ended:
            return None
        return lo, hi, context

    @property
    def done(self) -> bool:
        """The stream ended and every frame is decoded: the next step finishes the request."""
        return self.ended and self.decoded >= self.num_frames

    def codes(self, lo: int, hi: int) -> torch.Tensor:
        if len(self.frames) > 1:
            self.frames = [torch.cat(self.frames)]
        return self.frames[0][lo:hi]


class Code2WavCore:
    """An engine core whose model is Qwen3-Omni's code2wav (see the module doc)."""

    UTILITIES = frozenset({"reset_prefix_cache"})

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = torch.device(resolve_device(config.runner.device))
        dtype = resolve_dtype(mc.dtype, str(self.device))
        if mc.submodel != "code2wav":
            raise ValueError(f"the code2wav engine core serves submodel 'code2wav', not {mc.submodel!r}")
        self.model, self.hf_config = load_model(mc.model, dtype, self.device, None, "code2wav")
        self.decoder = self.model.code2wav
        self.dtype = dtype
        self.max_windows = config.scheduler.max_num_seqs
        self.streams: OrderedDict[str, _Stream] = OrderedDict()
        self._done: list[EngineCoreOutput] = []         # ended outside a step (abort, refused, failed)
        self.wake: Callable[[], None] = lambda: None
        self.num_steps = 0
        self.step_seconds = 0.0
        self.num_requests_added = 0
        self.num_requests_refused = 0
        self.num_aborted = 0
        self.num_step_failures = 0
        self.frames_decoded = 0
        logger.info("code2wav engine ready: model=%s dtype=%s device=%s, %d samples per frame", mc.model,
                    str(dtype).removeprefix("torch."), self.device, self.decoder.total_upsample)

    # ---- the engine core protocol ----------------------------------------------------------------
    def info(self, probe_sites: bool = False) -> EngineInfo:
        mc = self.config.model
        c = self.hf_config
        return EngineInfo(
            version=pellucid.__version__, model=mc.model, tokenizer=mc.tokenizer_dir,
            model_name=mc.served_model_name or mc.model, architecture=type(self.model).__name__,
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device), pid=os.getpid(),
            max_model_len=int(c.max_position_embeddings), vocab_size=int(c.codebook_size),
            num_hidden_layers=int(c.num_hidden_layers), hidden_size=int(c.hidden_size), num_blocks=0,
            block_size=0, max_num_seqs=self.max_windows, max_num_batched_tokens=0, enable_chunked_prefill=False,
            enable_prefix_caching=False, async_scheduling=False, attention_backend="none", cuda_graphs=False,
            lm_head={"name": "none"})

    def add_request(self, request: EngineCoreRequest) -> None:
        rid = request.request_id
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already in use")
        spec = (request.extras or {}).get(STAGE_INPUT_KEY)
        if not isinstance(spec, StageInputSpec):
            raise ValueError("code2wav decodes frames from the talker: a request needs a StageInputSpec in "
                             f"extras[{STAGE_INPUT_KEY!r}]")
        windows = spec.params if spec.params is not None else DecodeWindows()
        if (not isinstance(windows, DecodeWindows) or windows.chunk_size < 1 or windows.left_context < 0
                or (windows.first_chunk_size is not None and windows.first_chunk_size < 1)):
            raise ValueError("code2wav windows must be DecodeWindows(chunk_size >= 1, left_context >= 0, "
                             f"first_chunk_size None or >= 1), got {windows!r}")
        self.streams[rid] = _Stream(request, spec, windows)
        self.num_requests_added += 1

    def refuse(self, request: EngineCoreRequest, error: str) -> None:
        self._done.append(EngineCoreOutput(request.request_id, [], finish_reason="error", error=error))
        self.num_requests_refused += 1

    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        num_output_tokens: list[int] | None = None) -> None:
        for rid in request_ids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                self._done.append(EngineCoreOutput(rid, [], finish_reason="abort"))
                self.num_aborted += 1

    def fail_requests(self, request_ids: list[str], error: str) -> None:
        for rid in request_ids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                self._done.append(EngineCoreOutput(rid, [], finish_reason="error", error=error))

    def abort_all(self, error: str | None = None) -> None:
        ids = list(self.streams)
        if error is None:
            self.finish_requests(ids)
        else:
            self.fail_requests(ids, error)

    def has_unfinished_requests(self) -> bool:
        # A stream that ended with nothing left to decode (no frames, or a last chunk of none after the last
        # window) still needs a step to finish: without it the loop would wait for inputs that never come.
        return bool(self._done) or any(s.done or s.next_window() is not None for s in self.streams.values())

    def has_deferred_outputs(self) -> bool:
        return False

    def wait_deferred(self, timeout: float | None = None) -> None:
        pass

    def utility(self, name: str) -> Callable[..., Any]:
        if name == f"{STAGE_INPUT_KEY}.arrived":
            return self.arrived
        if name == "reset_prefix_cache":
            return lambda: 0
        raise ValueError(f"{name!r} is not a code2wav engine utility (known: {STAGE_INPUT_KEY}.arrived)")

    def arrived(self, request_id: str, from_stage: str, to_stage: str, index: int, final: bool) -> bool:
        stream = self.streams.get(request_id)
        if stream is None:
            return False
        key = ChunkKey(request_id, from_stage, to_stage, index)
        try:
            for chunk in stream.receiver.arrived(Notice(key, final), open_connector(stream.spec.connector)):
                if chunk.num_rows:
                    codes = chunk.payload["codes"].to(torch.int64)
                    if codes.dim() != 2 or codes.shape[1] != self.decoder.num_quantizers:
                        raise ValueError(f"frames must be [n, {self.decoder.num_quantizers}] codes, got "
                                         f"{tuple(codes.shape)}")
                    if bool((codes < 0).any()) or bool((codes >= self.decoder.codebook_size).any()):
                        raise ValueError(f"codes outside the codebook [0, {self.decoder.codebook_size})")
                    stream.frames.append(codes)
                    stream.num_frames += codes.shape[0]
                stream.ended = stream.ended or chunk.final
        except Exception as exc:
            message = f"stage {to_stage} input from {from_stage}: {type(exc).__name__}: {exc}"
            logger.error("request %s: %s", request_id, message)
            self.fail_requests([request_id], message)
            return False
        return True

    def step(self) -> EngineCoreOutputs:
        started = time.perf_counter()
        windows: dict[int, list[tuple[_Stream, int, int, int]]] = {}
        count = 0
        for stream in self.streams.values():
            window = stream.next_window()
            if window is not None and count < self.max_windows:
                lo, hi, context = window
                windows.setdefault(hi - lo, []).append((stream, lo, hi, context))
                count += 1
        if windows:
            self.num_steps += 1
        for length, group in windows.items():
            try:
                self._decode(group)
            except Exception as exc:     # one bad batch fails its requests, the engine goes on
                self.num_step_failures += 1
                logger.exception("code2wav step failed; failing its %d requests", len(group))
                self.fail_requests([s.request_id for s, *_ in group], f"{type(exc).__name__}: {exc}")
        outputs = []
        for stream, *_ in (entry for group in windows.values() for entry in group):
            if stream.request_id not in self.streams:
                continue
            out = EngineCoreOutput(stream.request_id, [])
            out.events = {"audio": torch.cat(stream.audio) if len(stream.audio) > 1 else stream.audio[0]}
            stream.audio = []
            if stream.done:
                out.finish_reason = "stop"
                del self.streams[stream.request_id]
            outputs.append(out)
        # Streams that ended with no window left to decode (no frames, or all decoded before the end).
        for stream in [s for s in self.streams.values() if s.done]:
            del self.streams[stream.request_id]
            outputs.append(EngineCoreOutput(stream.request_id, [], finish_reason="stop",
                                            events={"audio": torch.zeros(0)}))
        outputs.extend(self._done)
        self._done = []
        self.step_seconds += time.perf_counter() - started
        return EngineCoreOutputs(outputs)

    @torch.inference_mode()
    def _decode(self, group: list[tuple[_Stream, int, int, int]]) -> None:
        codes = torch.stack([stream.codes(lo, hi) for stream, lo, hi, _ in group])    # [B, T, Q]
        # One window per row; a row's samples past its left context are its window's (chunked_decode).
        wav = self.decoder(codes.transpose(1, 2).to(self.device)).float().to("cpu")    # [B, 1, samples]
        for row, (stream, lo, hi, context) in enumerate(group):
            stream.audio.append(wav[row, 0, context * self.decoder.total_upsample:])
            self.frames_decoded += hi - stream.decoded
            stream.decoded = hi

    def fail_in_flight(self, error: str) -> EngineCoreOutputs:
        self.num_step_failures += 1
        self.abort_all(error)
        return self.step()

    # ---- processes beside the core: code2wav starts none (EngineCore's tensor-parallel workers) ----
    def set_fatal_handler(self, handler: Callable[[str], None]) -> None:
        """Nothing beside this core can fail it from another thread."""

    def shutdown(self) -> None:
        """Nothing beside this core to stop."""

    def stats(self) -> EngineStats:
        running = sum(1 for s in self.streams.values() if s.next_window() is not None)
        return EngineStats(num_running=running, num_waiting=len(self.streams) - running, num_steps=self.num_steps,
                           step_seconds=self.step_seconds, num_step_failures=self.num_step_failures,
                           num_aborted=self.num_aborted, num_requests_added=self.num_requests_added,
                           num_requests_refused=self.num_requests_refused,
                           generation_tokens_total=self.frames_decoded)
