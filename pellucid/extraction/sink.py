"""Extraction files written by the engine: the `extraction` request feature.

An extraction request carries two features: `trace` (the saves of the hidden states, kept on the
device) and `extraction` (an ExtractionTarget: where the sample goes). When the request finishes, the
engine core stages its saves to pinned host memory on a side stream and hands the sample to the
directory's DatasetWriter, whose threads write the file; the hidden states never travel to the
frontend. The request's final output carries only {"sample_id", "num_tokens"}, or, for a target that
waits for its file (the server's `extract_hidden_states` with output "server"), {"file", ...} once the
manifest lists it.

A frontend opens a directory's writer with the engine utility "extraction.open" (it returns the samples
the manifest already lists, for resuming) before it sends requests for it, and closes it with
"extraction.close" (which waits for the writer threads and returns what they wrote, or raises the
first I/O error with the final count).
"""
from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pellucid.engine.features import EngineFeature, RequestFeature, register_feature
from pellucid.extraction.spec import ExtractionSpec
from pellucid.extraction.staging import HostStager
from pellucid.extraction.writer import DatasetWriter, ExtractionError, SampleRecord
from pellucid.logger import get_logger
from pellucid.tracing.plan import TRACE_KEY

logger = get_logger(__name__)

EXTRACTION_KEY = "extraction"


@dataclass(frozen=True)
class ExtractionTarget:
    output_dir: str                     # an absolute path, opened with "extraction.open"
    sample_id: str
    prompt_length: int                  # the sample's prompt (the request's prompt is prompt + response)
    layers: tuple[int, ...]
    num_model_layers: int
    loss_mask: tuple[bool, ...] | None = None
    wait_written: bool = False          # the final output waits until the manifest lists the file


class ExtractionSink(RequestFeature):
    key = EXTRACTION_KEY
    step_ahead = True
    publishes_outputs = True
    order = 10          # after tracing, whose saves it consumes

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> ExtractionTarget:
        if not isinstance(value, ExtractionTarget):
            raise ValueError(f"extras['extraction'] must be an ExtractionTarget, got {type(value).__name__}")
        if params.n != 1:
            raise ValueError("an extraction request must have n=1")
        if value.loss_mask is not None and len(value.loss_mask) != len(prompt_token_ids):
            raise ValueError(f"the loss mask has {len(value.loss_mask)} entries for {len(prompt_token_ids)} tokens")
        return value

    def for_engine(self, engine: Any) -> "EngineExtractionSinks":
        return EngineExtractionSinks()


class EngineExtractionSinks(EngineFeature):
    """One engine's open extraction directories."""

    def __init__(self) -> None:
        self._writers: dict[str, DatasetWriter] = {}
        self._stager = HostStager()

    def utilities(self) -> dict[str, Callable[..., Any]]:
        return {"open": self.open, "close": self.close}

    def open(self, output_dir: str, job_info: dict[str, Any], shard_size: int) -> dict[str, Any]:
        """Open (or find open, with the same settings) the writer of a directory; returns the sample ids
        its manifest lists. ExtractionError when another job writes it or its settings differ."""
        output_dir = os.path.abspath(output_dir)
        writer = self._writers.get(output_dir)
        if writer is None:
            writer = self._writers[output_dir] = DatasetWriter(output_dir, job_info, shard_size)
        elif writer.shard_size != shard_size:
            raise ExtractionError(f"{output_dir!r} is open with shard_size={writer.shard_size}, not {shard_size}")
        return {"done_ids": sorted(writer.done_ids), "num_existing": writer.num_existing_samples}

    def close(self, output_dir: str) -> dict[str, Any]:
        """Write what is buffered, wait for the writer threads and release the directory; what this writer
        wrote, or ExtractionError (the first I/O error, with the final count)."""
        writer = self._writers.pop(os.path.abspath(output_dir), None)
        if writer is None:
            raise ExtractionError(f"no extraction is open for {output_dir!r}")
        writer.close()
        return {"num_samples": writer.num_samples_written, "num_tokens": writer.num_tokens_written,
                "files": list(writer.files_written)}

    def prepare(self, request: Any) -> None:
        target = request.extras[EXTRACTION_KEY]
        if not isinstance(target, ExtractionTarget):
            raise ValueError(f"extras['extraction'] must be an ExtractionTarget, got {type(target).__name__}")
        if TRACE_KEY not in request.extras:
            raise ValueError("an extraction request needs the trace of its hidden states (extras['trace'])")
        if os.path.abspath(target.output_dir) not in self._writers:
            raise ValueError(f"no extraction is open for {target.output_dir!r} (open it with the engine utility "
                             "'extraction.open' first)")

    def after_step(self, changed: list[Any]) -> None:
        for request in changed:
            if request.is_finished and EXTRACTION_KEY in request.extras:
                request.feature_outputs = {EXTRACTION_KEY: self._write(request)}

    def _write(self, request: Any) -> Any:
        """The sample's outputs: its write queued (or a Future of its file), or {"error": ...}."""
        target: ExtractionTarget = request.extras[EXTRACTION_KEY]
        outputs = request.feature_outputs or {}
        num_tokens = request.num_prompt_tokens
        try:
            if request.error is not None:
                raise ExtractionError(f"the extraction request failed: {request.error}")
            if "trace_error" in outputs:
                raise ExtractionError(f"the extraction request failed: {outputs['trace_error']['message']}")
            if request.status.value == "abort":
                raise ExtractionError("the extraction request was aborted")
            spec = ExtractionSpec(target.layers, target.num_model_layers)
            columns = spec.columns_from_saves(outputs.get("saves"), outputs.get("save_positions"), num_tokens)
            mask = torch.tensor(target.loss_mask, dtype=torch.bool) if target.loss_mask is not None else None
            record = SampleRecord(target.sample_id, torch.tensor(request.prompt_token_ids, dtype=torch.int64),
                                  self._stager.stage(columns), target.prompt_length, mask)
            written = self._writers[os.path.abspath(target.output_dir)].add(record)
        except (ExtractionError, RuntimeError, KeyError) as exc:
            return {"error": str(exc)}
        info = {"sample_id": target.sample_id, "num_tokens": num_tokens, "prompt_length": target.prompt_length}
        if not target.wait_written:
            return info
        described: Future[dict[str, Any]] = Future()

        def on_written(done: Future) -> None:
            error = done.exception()
            if error is not None:
                described.set_exception(error)
            else:
                described.set_result({**info, "file": done.result()})
        written.add_done_callback(on_written)
        return described


register_feature(ExtractionSink())
