"""The offline API, shaped like vLLM's `LLM` so users can switch by changing an import."""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from pellucid.config import EngineConfig
from pellucid.engine.engine_core import EngineCore
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tokenizer import apply_chat_template

logger = get_logger(__name__)

PromptType = str | list[int] | dict[str, Any]


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[str | list[int]]:
    """Accept a string, token ids, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of those."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out: list[str | list[int]] = []
    for p in prompts:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                p = list(p["prompt_token_ids"])
            elif "prompt" in p:
                p = p["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        out.append(p)
    return out


class LLM:
    """`LLM(model=DIR, dtype=..., max_model_len=..., ...)`; with no model, the embedded default model."""

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        if model is None or model == "default":
            from pellucid.default_model import ensure_default_model
            model = ensure_default_model()
        self.engine = EngineCore(EngineConfig.from_kwargs(model, **engine_kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = EngineCore(config)
        llm._ids = itertools.count()
        return llm

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, extras: Sequence[dict[str, Any] | None] | None = None) -> list[RequestOutput]:
        prompt_list = normalize_prompts(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        extras_list = list(extras) if extras is not None else [None] * len(prompt_list)
        for p, sp in zip(prompt_list, params):   # validate everything before queueing anything
            sp.validate()
            self.engine.validate_prompt(p)
        ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        for rid, p, sp, ex in zip(ids, prompt_list, params, extras_list):
            # Final-only: generate() returns finished outputs, so the engine builds nothing per step.
            self.engine.add_request(rid, p, sp, ex, stream=False)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.engine.tokenizer, conv, add_generation_prompt,
                                       **(chat_template_kwargs or {})) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def trace(self, prompts: PromptType | Sequence[PromptType] | None = None,
              sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Any:
        """`with llm.trace(prompts, params) as tr:` read and edit activations (see docs/tracing.md).
        Default params: greedy, max_tokens=1 (one forward over each prompt)."""
        from pellucid.tracing.api import trace
        return trace(self, prompts, sampling_params)

    def sites(self) -> list[Any]:
        """Every traceable site (`model.layers.0.output`, ..., `logits`, `tokens`) with its per-token shape."""
        from pellucid.tracing.api import sites
        return sites(self.engine.runner)

    # ---- hidden-state extraction (pellucid/extraction) -------------------------------------------
    def extract_hidden_states(self, data: Any, layers: Sequence[int], output_dir: str,
                              generate: SamplingParams | None = None, shard_size: int = 1, progress: bool = True,
                              skip_invalid: bool = False) -> Any:
        """Write the hidden states after decoder `layers` (-1: final normed output) of every token of `data`
        (prompts, token id lists, conversations or {"id", ...} records) to safetensors files plus a
        manifest in `output_dir`; resumes a job found there. With `generate`, the model first writes
        the response and the states cover prompt + response. Returns an ExtractionSummary.
        See docs/extraction.md."""
        from pellucid.extraction.job import extract_hidden_states
        return extract_hidden_states(self, data, layers, output_dir, generate=generate, shard_size=shard_size,
                                     progress=progress, skip_invalid=skip_invalid)
    # ---- hidden-state extraction (end) -----------------------------------------------------------

    def _params_list(self, sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request in `ids` finished; outputs in the order of `ids`."""
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2,
                   dynamic_ncols=True)
        start, out_tokens = time.monotonic(), 0
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    pending.discard(out.request_id)
                    final[out.request_id] = out
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if out.error:
                        logger.error("request %s failed: %s", out.request_id, out.error)
                    bar.update(1)
                    bar.set_postfix_str(f"output {out_tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s")
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with unfinished requests: {sorted(pending)[:5]}")
        bar.close()
        return [final[i] for i in ids]
