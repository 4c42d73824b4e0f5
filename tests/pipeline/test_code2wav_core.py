"""The code2wav engine core run by its own loop in a thread, as a pipeline stage runs it: a stream whose end
arrives with nothing left to decode (a talker that stopped before its first frame, or whose last chunk carried
no frames after a complete window) still finishes, instead of the loop waiting for inputs that never come."""
from __future__ import annotations

import time

import pytest
import torch

from pellucid.config import EngineConfig
from pellucid.engine.core_client import make_client
from pellucid.engine.messages import EngineCoreRequest
from pellucid.pipeline.code2wav_core import DecodeWindows
from pellucid.pipeline.connectors import Chunk, ChunkKey, ConnectorSpec, forget_inproc, open_connector
from pellucid.pipeline.graph import qwen3_omni_graph
from pellucid.pipeline.stage_features import STAGE_INPUT_KEY, StageInputSpec
from pellucid.sampling_params import SamplingParams
from pellucid.tiny_omni import CODEBOOK, NUM_CODE_GROUPS

WINDOW = 4
ARRIVED = f"{STAGE_INPUT_KEY}.arrived"


@pytest.fixture()
def code2wav(omni_dir):
    graph = qwen3_omni_graph(1, decode_chunk=WINDOW, left_context=2)
    stage = graph.stage("code2wav")
    config = EngineConfig.from_kwargs(omni_dir, submodel=stage.submodel, device="cpu", engine_process=False,
                                      **stage.engine_args)
    config.core = stage.core
    client = make_client(config, True)      # the engine loop in a thread of its own
    spec = ConnectorSpec("inproc", f"test-code2wav-{time.monotonic_ns()}")
    yield client, spec, DecodeWindows(**stage.params)
    client.shutdown()
    forget_inproc(spec.name)


def finished_output(client, request_id: str, audio: list[torch.Tensor], timeout: float = 20.0):
    """The request's final output, and its audio: `audio` (what came before) and every output's until then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for out in client.get_outputs(timeout=0.2).outputs:
            if out.request_id != request_id:
                continue
            if out.events and "audio" in out.events:
                audio.append(out.events["audio"])
            if out.finish_reason is not None:
                return out, torch.cat(audio) if audio else torch.zeros(0)
    raise AssertionError(f"request {request_id} did not finish within {timeout} s")


def send(client, spec, request_id: str, index: int, chunk: Chunk) -> None:
    key = ChunkKey(request_id, "talker", "code2wav", index)
    open_connector(spec).put(key, chunk)
    assert client.start_utility(ARRIVED, request_id, "talker", "code2wav", index, chunk.final).result(timeout=20)


def run_stream(client, spec, windows, request_id: str, codes: torch.Tensor, empty_end: bool):
    """Send `codes` in whole windows, the end either on the last of them or in a chunk of no frames after it;
    the request's final output and its audio."""
    client.add_request(EngineCoreRequest(request_id, [], SamplingParams(max_tokens=1), time.monotonic(), True,
                                         {STAGE_INPUT_KEY: StageInputSpec("code2wav", "talker", spec, windows)}))
    starts = list(range(0, len(codes), WINDOW))
    audio: list[torch.Tensor] = []
    for index, first in enumerate(starts):
        final = not empty_end and index == len(starts) - 1
        send(client, spec, request_id, index, Chunk(first, WINDOW, {"codes": codes[first:first + WINDOW]}, final))
        if not empty_end:
            continue
        # The window is decoded before the end arrives (the case that left the request waiting).
        decoded = len(audio)
        deadline = time.monotonic() + 20
        while len(audio) == decoded:
            assert time.monotonic() < deadline, "a whole window was not decoded"
            audio += [out.events["audio"] for out in client.get_outputs(timeout=0.2).outputs
                      if out.request_id == request_id and out.events and "audio" in out.events]
    if empty_end:
        send(client, spec, request_id, len(starts), Chunk(len(codes), 0, {}, final=True))
    return finished_output(client, request_id, audio)


@pytest.mark.parametrize("frames_before_end", [0, WINDOW, 2 * WINDOW])
def test_a_stream_that_ends_with_nothing_left_to_decode_finishes(code2wav, frames_before_end: int) -> None:
    client, spec, windows = code2wav
    codes = torch.randint(0, CODEBOOK, (frames_before_end, NUM_CODE_GROUPS),
                          generator=torch.Generator().manual_seed(frames_before_end))
    out, audio = run_stream(client, spec, windows, f"empty-end-{frames_before_end}", codes, empty_end=True)
    assert out.finish_reason == "stop" and out.error is None
    if frames_before_end == 0:
        assert len(audio) == 0
        return
    # The same frames with the end riding on their last chunk (the usual path, checked against transformers in
    # test_omni_vs_hf.py) give the same audio.
    reference_out, reference = run_stream(client, spec, windows, f"end-on-last-{frames_before_end}", codes, False)
    assert reference_out.finish_reason == "stop" and len(reference) > 0
    assert torch.equal(audio, reference)
