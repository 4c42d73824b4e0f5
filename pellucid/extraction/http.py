"""Extraction over HTTP: the `extract_hidden_states` field of `/v1/completions`.

    "extract_hidden_states": {"layers": [2, 18, -1], "output": "inline" | "server"}

After the completion is generated, one traced prefill over prompt + completion (as the offline
`generate` mode does) takes the hidden states of every token. Each choice then carries
`"hidden_states"`: with "inline", `{"data": <base64 safetensors>, "layers", "num_tokens", "prompt_length"}`
(tensors `hidden_states` [T, L, H], `input_ids` [T], `prompt_length`); with "server", the engine core
writes the sample to the server's `--extract-dir` (under `layers_<ids>/`, a regular extraction
directory with a manifest; the states never pass through the API server) and the choice carries
`{"file", "id", "layers", "num_tokens", "prompt_length"}` once the manifest lists the file. The
server never writes where a client says: any other key, or an output that is not one of the two
words, is refused (HTTP 400), as is an out-of-range layer.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.extraction.job import job_info
from pellucid.extraction.sink import EXTRACTION_KEY, ExtractionTarget
from pellucid.extraction.spec import ExtractionSpec
from pellucid.extraction.writer import SampleRecord
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
        self._opened: dict[tuple[int, ...], str] = {}     # layer set -> its directory, open in the engine
        self._lock = asyncio.Lock()
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
        spec = ExtractionSpec.resolve(value["layers"], self.llm.info.num_hidden_layers, self.llm.info.backbone)
        return ExtractionRequest(spec, output)

    async def extract(self, request: ExtractionRequest, prompt_ids: list[int], completion_ids: list[int],
                      sample_id: str) -> dict[str, Any]:
        """The choice's `hidden_states` field for prompt + completion."""
        token_ids = list(prompt_ids) + list(completion_ids)
        if len(token_ids) >= self.llm.max_model_len:
            raise ValueError(f"prompt + completion has {len(token_ids)} tokens; extracting hidden states needs fewer "
                             f"than max_model_len={self.llm.max_model_len}: lower max_tokens")
        spec = request.spec
        field = {"layers": list(spec.layers), "num_tokens": len(token_ids), "prompt_length": len(prompt_ids)}
        if request.output == "inline":
            final = await self._run(token_ids, spec.extras())
            record = SampleRecord(sample_id, torch.tensor(token_ids, dtype=torch.int64),
                                  spec.hidden_states(final, len(token_ids)), len(prompt_ids))
            field["data"] = tensors_to_b64(record.tensors())
            return field
        directory = await self._open(spec)
        target = ExtractionTarget(directory, sample_id, len(prompt_ids), spec.layers, spec.num_model_layers,
                                  wait_written=True)
        final = await self._run(token_ids, {**spec.extras(keep_on_device=True), EXTRACTION_KEY: target})
        written = final.extras.get(EXTRACTION_KEY) or {"error": "the engine reported no extraction"}
        if "error" in written:
            raise RuntimeError(f"writing the hidden states failed: {written['error']}")
        field.update(file=os.path.join(os.path.basename(directory), written["file"]), id=sample_id)
        return field

    async def _run(self, token_ids: list[int], extras: dict[str, Any]) -> Any:
        final = None
        async for output in self.llm.generate(token_ids, _EXTRACT_PARAMS, extras=extras):
            final = output
        assert final is not None
        return final

    async def _open(self, spec: ExtractionSpec) -> str:
        """The layer set's directory, opened in the engine once: one extraction directory per layer set, so
        each is a consistent data set with its own manifest."""
        assert self.extract_dir is not None
        async with self._lock:
            directory = self._opened.get(spec.layers)
            if directory is None:
                info = self.llm.info
                directory = os.path.join(self.extract_dir, "layers_" + "_".join(str(layer) for layer in spec.layers))
                job = job_info(info.model_name, info.model, info.dtype, spec, info.hidden_size, None)
                job["generate"] = "per-request (server)"
                await self.llm.call_utility(f"{EXTRACTION_KEY}.open", directory, job, 1)
                self._opened[spec.layers] = directory
            return directory

    async def close(self) -> None:
        """Close the engine's writers of this server's directories (waits for files being written)."""
        for directory in self._opened.values():
            try:
                await self.llm.call_utility(f"{EXTRACTION_KEY}.close", directory)
            except Exception as exc:
                logger.error("closing the extraction directory %s failed: %s", directory, exc)
        self._opened.clear()
