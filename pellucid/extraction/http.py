"""Extraction over HTTP: the `extract_hidden_states` field of `/v1/completions`.

    "extract_hidden_states": {"layers": [2, 18, -1], "output": "inline" | "server"}

After the completion is generated, one traced prefill over prompt + completion (as the offline
`generate` mode does) takes the hidden states of every token. Each choice then carries
`"hidden_states"`: with "inline", `{"data": <base64 safetensors>, "layers", "num_tokens", "prompt_length"}`
(tensors `hidden_states` [T, L, H], `input_ids` [T], `prompt_length`); with "server", the sample is
written to the server's `--extract-dir` (under `layers_<ids>/`, a regular extraction directory with
a manifest) and the choice carries `{"file", "id", "layers", "num_tokens", "prompt_length"}`. The
server never writes where a client says: any other key, or an output that is not one of the two
words, is refused (HTTP 400), as is an out-of-range layer.
"""
from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.extraction.job import job_info
from pellucid.extraction.spec import ExtractionSpec
from pellucid.extraction.writer import DatasetWriter, SampleRecord
from pellucid.logger import get_logger
from pellucid.sampling_params import SamplingParams
from pellucid.tracing.serialization import tensors_to_b64

logger = get_logger(__name__)

FIELD = "extract_hidden_states"
OUTPUTS = ("inline", "server")
_EXTRACT_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


@dataclass(frozen=True)
class ExtractionRequest:
    spec: ExtractionSpec
    output: str


class ServerExtraction:
    """Validates the field, runs the extraction pass for each choice, and owns the server's writers."""

    def __init__(self, async_llm: Any, extract_dir: str | None) -> None:
        self.llm = async_llm
        self.extract_dir = os.path.abspath(extract_dir) if extract_dir else None
        self._writers: dict[tuple[int, ...], DatasetWriter] = {}
        self._lock = threading.Lock()
        if self.extract_dir is not None:
            os.makedirs(self.extract_dir, exist_ok=True)
            if not os.access(self.extract_dir, os.W_OK):
                raise ValueError(f"--extract-dir {self.extract_dir!r} is not writable")

    def parse(self, value: Any, stream: bool, has_interventions: bool) -> ExtractionRequest | None:
        """The validated field (None when absent); ValueError naming the problem (-> HTTP 400)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"{FIELD} must be an object {{\"layers\": [...], \"output\": \"inline\" | \"server\"}}")
        unknown = sorted(set(value) - {"layers", "output"})
        if unknown:
            raise ValueError(f"{FIELD} takes only 'layers' and 'output', got {unknown}; files go to the server's "
                             f"configured directory (--extract-dir), never to a path chosen by the client")
        output = value.get("output", "inline")
        if output not in OUTPUTS:
            raise ValueError(f"{FIELD}.output must be 'inline' or 'server', got {output!r}; the server never writes "
                             f"to a path chosen by the client")
        if output == "server" and self.extract_dir is None:
            raise ValueError(f"{FIELD}.output='server' needs a server started with --extract-dir; use 'inline'")
        if stream:
            raise ValueError(f"{FIELD} is not supported with stream=true (the states come with the final response)")
        if has_interventions:
            raise ValueError(f"{FIELD} cannot be combined with interventions (the extraction pass runs the unedited "
                             f"model); use save ops in interventions instead")
        if "layers" not in value:
            raise ValueError(f"{FIELD} needs 'layers' (decoder-layer indices, -1 for the final normed output)")
        spec = ExtractionSpec.resolve(value["layers"], self.llm.info.num_hidden_layers)
        return ExtractionRequest(spec, output)

    async def extract(self, request: ExtractionRequest, prompt_ids: list[int], completion_ids: list[int],
                      sample_id: str) -> dict[str, Any]:
        """The choice's `hidden_states` field for prompt + completion."""
        token_ids = list(prompt_ids) + list(completion_ids)
        if len(token_ids) >= self.llm.max_model_len:
            raise ValueError(f"prompt + completion has {len(token_ids)} tokens; extracting hidden states needs fewer "
                             f"than max_model_len={self.llm.max_model_len}: lower max_tokens")
        final = None
        async for output in self.llm.generate(token_ids, _EXTRACT_PARAMS, extras=request.spec.extras()):
            final = output
        assert final is not None
        record = SampleRecord(sample_id, torch.tensor(token_ids, dtype=torch.int64),
                              request.spec.hidden_states(final, len(token_ids)), len(prompt_ids))
        field = {"layers": list(request.spec.layers), "num_tokens": len(token_ids), "prompt_length": len(prompt_ids)}
        if request.output == "inline":
            field["data"] = tensors_to_b64(record.tensors())
            return field
        writer = await asyncio.to_thread(self._writer, request.spec)
        name = await asyncio.to_thread(writer.write_now, record)
        field.update(file=os.path.join(os.path.basename(writer.output_dir), name), id=sample_id)
        return field

    def _writer(self, spec: ExtractionSpec) -> DatasetWriter:
        """One extraction directory per layer set, so each is a consistent data set with its own manifest."""
        assert self.extract_dir is not None
        with self._lock:
            writer = self._writers.get(spec.layers)
            if writer is None:
                engine = self.llm.info
                subdir = os.path.join(self.extract_dir, "layers_" + "_".join(str(layer) for layer in spec.layers))
                info = job_info(engine.model_name, engine.model, engine.dtype, spec, engine.hidden_size, None)
                info["generate"] = "per-request (server)"
                writer = DatasetWriter(subdir, info, shard_size=1, background=False)
                self._writers[spec.layers] = writer
            return writer

    def close(self) -> None:
        with self._lock:
            for writer in self._writers.values():
                writer.close()
            self._writers.clear()
