"""What flows between Qwen3-Omni's stages, and how the talker's inputs are assembled from it.

thinker -> talker, per thinker position the thinker computed (chunks of "tokens" rows): the token id,
its input embedding (`embed`) and the accept-layer hidden state (`hidden`); the first chunk also carries
the embeddings of the TTS tokens (bos, eos, pad). talker -> code2wav, per talker output token: its
frame's codes (`codes`, one per codebook), for the tokens the talker fed back (the last one never is).

The talker's sequence, as transformers' Qwen3OmniMoeForConditionalGeneration.generate builds it (text
input; `a` the position of the last `<|im_start|>assistant` of the thinker's prompt, F the number of
thinker positions computed when the thinker ended):

    user turns:   text_projection(embed[q]) for every position q of the prompt's user turns
                  (hidden_projection(hidden[q]) at audio/image/video placeholders)
    assistant:    text_projection(embed[a..a+2])                      (<|im_start|>assistant\\n)
                  text_projection(tts_pad) + codec(nothink | think_bos | think_eos | speaker)
                  text_projection(tts_bos) + codec(codec_pad)
                  text_projection(embed[a+3]) + codec(codec_bos)     (the first text token)
    then each generated token j (a frame): codec(frame j) + text_projection(trailing[j]), trailing[j]
    being embed[a + 4 + j] while a + 4 + j < F, tts_eos at j = F - a - 4, tts_pad after.

So the talker can prefill once the thinker computed position a + 3, and its j-th decode waits for
thinker position a + 4 + j or the end of the thinker's stream (TalkerInputs.input_limit).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.models.qwen3_omni.configs import OmniConfig
from pellucid.models.qwen3_omni.talker import PROJECT_HIDDEN, PROJECT_TEXT, TALKER_INPUTS_KEY, TalkerStepInputs
from pellucid.runner.sampler import host_to_device, tensor_to_device

NUM_ASSISTANT_PREFIX = 3       # <|im_start|> assistant \n
NUM_ASSISTANT_ROWS = 9         # the prefix, 4 pad rows with the codec control ids, bos, the first text token


@dataclass(frozen=True)
class TalkerLayout:
    """Where the talker's prompt comes from in the thinker's sequence (computed by the frontend)."""

    user_positions: tuple[int, ...]     # thinker prompt positions of the user turns, in order
    assistant_start: int                # position of the last <|im_start|> followed by the assistant role
    speaker_id: int

    @property
    def prompt_len(self) -> int:
        return len(self.user_positions) + NUM_ASSISTANT_ROWS


def talker_layout(prompt_ids: list[int], omni: OmniConfig, voice: str) -> TalkerLayout:
    """The layout of a thinker prompt (ValueError when it has no assistant turn to speak)."""
    hf = omni.hf
    im_start, user, assistant = int(hf.im_start_token_id), int(hf.user_token_id), int(hf.assistant_token_id)
    # transformers: a position belongs to the role named right after the last <|im_start|> at or before it.
    user_positions = []
    last_start = 0
    for pos, token in enumerate(prompt_ids):
        if token == im_start:
            last_start = pos
        role = prompt_ids[min(last_start + 1, len(prompt_ids) - 1)]
        if role == user:
            user_positions.append(pos)
    starts = [i for i in range(len(prompt_ids) - 1) if prompt_ids[i] == im_start and prompt_ids[i + 1] == assistant]
    if not starts:
        raise ValueError("the prompt has no assistant turn (<|im_start|>assistant) for the talker to speak: build it "
                         "with the chat template and add_generation_prompt")
    return TalkerLayout(tuple(user_positions), starts[-1], omni.speaker_id(voice))


class TalkerInputs:
    """One talker request's inputs: what the thinker sent so far, and the frames the talker sampled."""

    def __init__(self, layout: TalkerLayout, omni: OmniConfig) -> None:
        self.layout = layout
        talker = omni.talker
        self.control_codes = (int(talker.codec_nothink_id), int(talker.codec_think_bos_id),
                              int(talker.codec_think_eos_id), layout.speaker_id)
        self.codec_pad, self.codec_bos = int(talker.codec_pad_id), int(talker.codec_bos_id)
        self.num_code_groups = omni.num_code_groups
        self.multimodal = omni.multimodal_token_ids
        self.token_ids: list[int] = []
        # What the thinker sent, [rows, thinker hidden], in buffers that double when full (chunks of one row
        # each would otherwise cost a copy of everything so far each time).
        self._embeds = torch.empty(0)
        self._hidden = torch.empty(0)
        self.tts: torch.Tensor | None = None        # [3, thinker hidden]: bos, eos, pad
        self.ended = False
        self.frames: dict[int, list[int]] = {}      # output token index -> its frame's codes

    # ---- what arrives ----
    def apply(self, payload: dict[str, Any], num_rows: int) -> None:
        if "tts_embeds" in payload:
            self.tts = payload["tts_embeds"]
        if num_rows:
            start = len(self.token_ids)
            self._embeds = _append(self._embeds, start, payload["embed"])
            self._hidden = _append(self._hidden, start, payload["hidden"])
            self.token_ids.extend(payload["token_ids"].tolist())

    def finish(self) -> None:
        self.ended = True
        if len(self.token_ids) <= self.layout.assistant_start + NUM_ASSISTANT_PREFIX:
            raise ValueError("the thinker ended before writing any text: there is nothing to speak")

    def record_frame(self, index: int, codes: list[int]) -> None:
        self.frames[index] = codes

    @property
    def input_limit(self) -> int:
        """Talker positions whose inputs are here (sys.maxsize once the thinker's stream ended)."""
        first_text = self.layout.assistant_start + NUM_ASSISTANT_PREFIX
        if len(self.token_ids) <= first_text or self.tts is None:
            return 0
        if self.ended:
            return sys.maxsize
        return self.layout.prompt_len + len(self.token_ids) - (first_text + 1)

    # ---- rows of a step ----
    def rows(self, start: int, count: int) -> tuple[torch.Tensor, list[int], list[list[int]]]:
        """(thinker vectors [count, H], projection per row, codes per row (padded with -1)) of talker
        positions [start, start + count)."""
        num_rows, embeds, hidden = len(self.token_ids), self._embeds, self._hidden
        if self.tts is None:
            raise RuntimeError("the talker was scheduled before the thinker's first chunk arrived")
        bos, eos, pad = self.tts[0], self.tts[1], self.tts[2]
        layout, groups = self.layout, self.num_code_groups
        num_user, a = len(layout.user_positions), layout.assistant_start
        vectors, projection, codes = [], [], []
        none = [-1] * groups
        for p in range(start, start + count):
            kind, code = PROJECT_TEXT, none
            if p < num_user:
                q = layout.user_positions[p]
                mm = self.token_ids[q] in self.multimodal
                vector, kind = (hidden[q], PROJECT_HIDDEN) if mm else (embeds[q], PROJECT_TEXT)
            elif p < num_user + NUM_ASSISTANT_PREFIX:
                vector = embeds[a + p - num_user]
            elif p < num_user + NUM_ASSISTANT_ROWS:
                i = p - num_user - NUM_ASSISTANT_PREFIX      # 0..5
                if i < 4:
                    vector, first = pad, self.control_codes[i]
                elif i == 4:
                    vector, first = bos, self.codec_pad
                else:
                    vector, first = embeds[a + NUM_ASSISTANT_PREFIX], self.codec_bos
                code = [first] + [-1] * (groups - 1)
            else:
                j = p - layout.prompt_len               # the generated token fed here
                if j not in self.frames:
                    raise RuntimeError(f"talker token {j} is fed but its frame was not recorded")
                code = self.frames[j]
                text = a + NUM_ASSISTANT_PREFIX + 1 + j
                if text < num_rows:
                    vector = embeds[text]
                elif not self.ended:
                    raise RuntimeError(f"talker position {p} was scheduled before thinker position {text} arrived")
                else:
                    vector = eos if text == num_rows else pad
            vectors.append(vector)
            projection.append(kind)
            codes.append(code)
        return torch.stack(vectors), projection, codes


def _append(buffer: torch.Tensor, start: int, rows: torch.Tensor) -> torch.Tensor:
    """`rows` written at row `start` of `buffer`, grown (doubled) when they do not fit."""
    end = start + rows.shape[0]
    if buffer.dim() != rows.dim() or buffer.shape[0] < end:
        capacity = 2 * buffer.shape[0] if buffer.dim() == rows.dim() else 0
        grown = torch.empty((max(end, capacity), *rows.shape[1:]), dtype=rows.dtype)
        if start:
            grown[:start] = buffer[:start]
        buffer = grown
    buffer[start:end] = rows
    return buffer


def talker_step_inputs(states: list[TalkerInputs], starts: list[int], counts: list[int],
                       device: torch.device) -> dict[str, Any]:
    """The forward-context extras of a talker step: every scheduled row's inputs, in batch order."""
    vectors, projection, codes = [], [], []
    for state, start, count in zip(states, starts, counts):
        v, p, c = state.rows(start, count)
        vectors.append(v)
        projection += p
        codes += c
    codes_tensor = torch.tensor(codes, dtype=torch.int64)
    inputs = TalkerStepInputs(
        thinker_vectors=tensor_to_device(torch.cat(vectors), device),
        projection=host_to_device(projection, torch.int64, device), codes=tensor_to_device(codes_tensor, device),
        any_hidden=PROJECT_HIDDEN in projection, any_codes=bool((codes_tensor >= 0).any()))
    return {TALKER_INPUTS_KEY: inputs}
