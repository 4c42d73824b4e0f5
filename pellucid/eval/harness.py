"""Perplexity through the engine, and agreement of engine configurations on the same text.

A configuration is a dict of `LLM` keyword arguments (`{"head": "flashhead", "head_options": {"probes": 64}}`,
`{"dtype": "bfloat16"}`, `{}` for the defaults). Everything but the head runs in the engine: final hidden
states are traced at `model.norm.output`, once per distinct set of non-head arguments. The head is then
built by the same registry the engine uses, with the configuration's options, and applied to those
states (pellucid/eval/heads.py says why and what is measured).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.eval.heads import adapter_for, score_rows

HEAD_KEYS = ("head", "head_options")


@dataclass
class Perplexity:
    tokens: int
    nll: float                 # summed negative log-likelihood (nats)

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def engine_perplexity(llm: Any, windows: list[list[int]]) -> Perplexity:
    """Perplexity from the engine's prompt logprobs (exact full-vocabulary logits, whatever the head):
    every token of a window but its first is scored given the tokens before it in the window."""
    from pellucid.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, tokens = 0.0, 0
    for out, window in zip(llm.generate(windows, params, use_tqdm=len(windows) > 1 and sys.stderr.isatty()), windows):
        if out.error:
            raise RuntimeError(f"perplexity request failed: {out.error}")
        for token, position in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= position[token].logprob
            tokens += 1
    return Perplexity(tokens, nll)


def final_hidden_states(llm: Any, windows: list[list[int]], batch: int = 64) -> list[torch.Tensor]:
    """Per window, the final normed hidden state of every position ([len(window), hidden])."""
    states: list[torch.Tensor] = []
    for start in range(0, len(windows), batch):
        with llm.trace(windows[start:start + batch]) as tr:
            saved = tr.model.norm.output.save()
        states.extend(saved[i] for i in range(len(windows[start:start + batch])))
    return states


def split_config(config: dict[str, Any]) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """(engine kwargs without the head, head name, head options)."""
    body = {k: v for k, v in config.items() if k not in HEAD_KEYS}
    return body, config.get("head") or "dense", dict(config.get("head_options") or {})


@dataclass
class ConfigResult:
    config: dict[str, Any]
    positions: int
    agreement: float           # greedy token equal to the reference's greedy token
    target_exact: float        # share of positions whose target logit the head computed exactly
    perplexity: float
    reference_perplexity: float

    @property
    def delta(self) -> float:
        return self.perplexity - self.reference_perplexity

    def as_dict(self) -> dict[str, Any]:
        return {"config": self.config, "positions": self.positions, "greedy_agreement": self.agreement,
                "target_logit_exact": self.target_exact, "perplexity": self.perplexity,
                "reference_perplexity": self.reference_perplexity, "perplexity_delta": self.delta,
                "perplexity_delta_relative": self.delta / self.reference_perplexity}


def compare_configs(model: str, windows: list[list[int]], reference: dict[str, Any],
                    candidates: list[dict[str, Any]]) -> list[ConfigResult]:
    """The reference configuration first (agreement 1 with itself), then each candidate."""
    from pellucid.config import resolve_device
    from pellucid.heads.flashhead.cli import read_head_weight
    from pellucid.heads.registry import build_head
    from pellucid.llm import LLM

    configs = [reference, *candidates]
    for config in configs:
        adapter_for(split_config(config)[1])          # fail before any model is loaded
    targets = torch.cat([torch.tensor(w[1:], dtype=torch.long) for w in windows])
    weight = read_head_weight(model)
    hidden_by_body: dict[str, torch.Tensor] = {}
    scores = []
    for config in configs:
        body, head_name, options = split_config(config)
        key = json.dumps(body, sort_keys=True)
        if key not in hidden_by_body:
            llm = LLM(model, **body)
            states = final_hidden_states(llm, windows)
            del llm
            # Heads run where the engine ran (saves come back on the host).
            hidden_by_body[key] = torch.cat([h[:-1] for h in states]).to(resolve_device(body.get("device", "auto")))
        hidden = hidden_by_body[key]
        adapter = adapter_for(head_name)
        head = build_head(head_name, weight.to(device=hidden.device, dtype=hidden.dtype),
                          adapter.build_options(options), model)
        with torch.no_grad():
            scores.append(score_rows(head, adapter, hidden, targets.to(hidden.device)))
    ref = scores[0]
    ref_ppl = math.exp(-float(ref.target_logprob.mean()))
    return [ConfigResult(config, len(targets), float((s.greedy == ref.greedy).double().mean()),
                         float(s.target_exact.double().mean()), math.exp(-float(s.target_logprob.mean())), ref_ppl)
            for config, s in zip(configs, scores)]
