"""SamplingParams, named and validated as in vLLM so users can switch by changing an import."""
from __future__ import annotations

from dataclasses import dataclass, field

from pellucid.structured.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# Integer settings travel to the engine as 64-bit integers (and seed torch generators, which take no more).
_INT64_MIN, _INT64_MAX = -2 ** 63, 2 ** 63 - 1
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # number of top alternatives returned with each sampled token
    prompt_logprobs: int | None = None  # number of top alternatives returned for each prompt token
    skip_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit (OpenAI's; in [-100, 100])
    allowed_token_ids: list[int] | None = None      # the only tokens the request may sample (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None   # a JSON schema, regex, choice or grammar to match
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field for any value the sampler cannot honour."""
        def bad(name: str, rule: str) -> None:
            raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        # The sampler computes in float32: a value past its range would become inf, and inf turns masked
        # (-inf) logits into NaN, so a banned or disallowed token could be drawn. NaN fails every comparison.
        if not 0 <= self.temperature <= _FLOAT32_MAX:
            bad("temperature", "must be a number >= 0 within float32's range")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= _FLOAT32_MAX:
            bad("repetition_penalty", "must be a number > 0 within float32's range")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "must be >= 0 and <= max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be >= 0")
        if self.seed is not None and (not isinstance(self.seed, int)
                                      or not _INT64_MIN <= self.seed <= _INT64_MAX - (self.n - 1)):
            bad("seed", "must be an integer in [-2**63, 2**63 - n] (sample i of n draws with seed + i)")
        for name in ("top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > _INT64_MAX:
                bad(name, "must be below 2**63")
        if any(not _is_token_id(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, 2**63), got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.logit_bias is not None:
            if any(not _is_token_id(t) for t in self.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {list(self.logit_bias)!r}")
            if any(not isinstance(b, (int, float)) or isinstance(b, bool) or not -100 <= b <= 100
                   for b in self.logit_bias.values()):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {self.logit_bias!r}")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids
                                                   or any(not _is_token_id(t) for t in self.allowed_token_ids)):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), got "
                             f"{self.allowed_token_ids!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    def token_ids_named(self) -> dict[str, list[int]]:
        """The token ids each field names (for the engine's check against its vocabulary)."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": self.allowed_token_ids or []}

    @property
    def edits_logits(self) -> bool:
        """Whether logit_bias, allowed_token_ids or structured_outputs change the distribution the request
        samples from."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.structured_outputs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1.0


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT64_MAX
