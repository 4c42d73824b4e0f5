"""Qwen3-Omni's requests in its pipeline: what each stage's engine gets for one client request.

- thinker: the chat prompt and the client's sampling parameters; with audio, extras["stage_output"] sends
  its per-position hidden states on to the talker;
- talker: a prompt of placeholder ids as long as the talker's prompt (stage_io.TalkerLayout, computed here
  from the thinker's prompt), its inputs from the thinker (extras["stage_input"]), its frames on to
  code2wav; sampled as transformers' generate samples it by default (temperature 0.9, top-k 50,
  repetition penalty 1.05; `talker_params` overrides, e.g. greedy);
- code2wav: no prompt, its frames from the talker, decoded in the stage's windows.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pellucid.engine.messages import EngineCoreRequest
from pellucid.models.qwen3_omni.configs import OmniConfig, check_text_prompt
from pellucid.models.qwen3_omni.stage_io import talker_layout
from pellucid.pipeline.code2wav_core import DecodeWindows
from pellucid.pipeline.connectors import ConnectorSpec
from pellucid.pipeline.graph import PipelineGraph
from pellucid.pipeline.stage_features import (STAGE_INPUT_KEY, STAGE_OUTPUT_KEY, OutputEdge, StageInputSpec,
                                              StageOutputSpec)
from pellucid.sampling_params import SamplingParams

SAMPLE_RATE = 24000         # Qwen3-Omni's code2wav output (not in its config)
DEFAULT_TALKER_MAX_TOKENS = 4096


def default_talker_params(seed: int | None = None) -> SamplingParams:
    """transformers' Qwen3OmniMoeForConditionalGeneration.generate defaults for the talker."""
    return SamplingParams(temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                          max_tokens=DEFAULT_TALKER_MAX_TOKENS, seed=seed)


@dataclass(frozen=True)
class AudioRequest:
    """What the client asked of the audio."""

    voice: str = "ethan"
    talker_params: SamplingParams | None = None     # None: default_talker_params (seeded from the text's seed)


class Qwen3OmniRequests:
    """Builds a client request's engine requests for each stage of a Qwen3-Omni pipeline."""

    def __init__(self, omni: OmniConfig, graph: PipelineGraph, connectors: dict[tuple[str, str], ConnectorSpec]) -> None:
        self.omni = omni
        self.graph = graph
        self.connectors = connectors
        names = set(graph.order)
        if names != {"thinker", "talker", "code2wav"} or graph.order != ("thinker", "talker", "code2wav"):
            raise ValueError(f"a Qwen3-Omni pipeline is thinker -> talker -> code2wav, got {' -> '.join(graph.order)}")
        params = graph.stage("code2wav").params
        self.windows = DecodeWindows(**params) if params else DecodeWindows()
        self.placeholder = int(omni.talker.codec_pad_id)    # suppressed when sampling: never penalised

    def check_voice(self, voice: str) -> None:
        self.omni.speaker_id(voice)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        check_text_prompt(prompt_ids, self.omni)

    def stage_requests(self, request_id: str, prompt_ids: list[int], thinker: EngineCoreRequest,
                       audio: AudioRequest | None) -> dict[str, EngineCoreRequest]:
        """The engine requests of each stage (only the thinker's without audio). `thinker` is the checked
        thinker request (InputProcessor), given its stage output here."""
        if audio is None:
            return {"thinker": thinker}
        layout = talker_layout(prompt_ids, self.omni, audio.voice)
        extras = dict(thinker.extras or {})
        extras[STAGE_OUTPUT_KEY] = StageOutputSpec("thinker", (self._edge("thinker", "talker"),))
        thinker = msgspec.structs.replace(thinker, extras=extras, stream=True)
        talker_params = audio.talker_params or default_talker_params(thinker.params.seed)
        talker = EngineCoreRequest(
            request_id, [self.placeholder] * layout.prompt_len, talker_params, thinker.arrival_time, True,
            {STAGE_INPUT_KEY: StageInputSpec("talker", "thinker", self.connectors[("thinker", "talker")], layout),
             STAGE_OUTPUT_KEY: StageOutputSpec("talker", (self._edge("talker", "code2wav"),))})
        code2wav = EngineCoreRequest(
            request_id, [], SamplingParams(max_tokens=1), thinker.arrival_time, True,
            {STAGE_INPUT_KEY: StageInputSpec("code2wav", "talker", self.connectors[("talker", "code2wav")],
                                             self.windows)})
        return {"thinker": thinker, "talker": talker, "code2wav": code2wav}

    def _edge(self, src: str, dst: str) -> OutputEdge:
        edge = next(e for e in self.graph.edges if e.src == src and e.dst == dst)
        return OutputEdge(dst, edge.chunk_size, self.connectors[(src, dst)], edge.first_chunk_size)


def check_audio_params(params: SamplingParams) -> None:
    if params.stop_strings:
        raise ValueError("stop strings cannot end a spoken answer (the talker may already have spoken past them); "
                         "use stop_token_ids, or ask for text only")
    # Each message starts with the field's name, which the server reports as the error's param.
    if params.n != 1:
        raise ValueError(f"n must be 1 for audio output, got n={params.n}")
    if params.max_tokens is not None and params.max_tokens < 2:
        # The talker speaks the text positions the thinker computed; the last token the thinker samples is
        # never fed back, so with one token there is nothing to speak.
        raise ValueError(f"max_tokens must be >= 2 for audio output, got {params.max_tokens}: the talker speaks the "
                         f"thinker's text, and the thinker's last sampled token is never computed")
