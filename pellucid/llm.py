"""The offline API, shaped like vLLM's `LLM` so users can switch by changing an import.

LLM is a frontend: it tokenizes, checks and fans out requests, and turns the engine core's token ids
into text. The engine core runs in this thread by default (engine_process=False: nothing is copied, and
`llm.engine` is the EngineCore for inspection); `engine_process=True` runs it in its own process.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tqdm.auto import tqdm

from pellucid.config import EngineConfig
from pellucid.engine.core_client import EngineCoreClient, EngineDeadError, start_engine
from pellucid.engine.engine_core import EngineCore, EngineInfo
from pellucid.engine.input_processor import InputProcessor, ProcessedRequest, send
from pellucid.engine.output_processor import OutputProcessor
from pellucid.logger import get_logger
from pellucid.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from pellucid.pooling.config import PoolerConfig, PoolingParams
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

    def __init__(self, model: str | None = None, pooler_config: dict[str, Any] | str | None = None,
                 **engine_kwargs: Any) -> None:
        """`pooler_config`: how `embed` pools, over the model directory's own (see pellucid/pooling/config.py)."""
        if model is None or model == "default":
            from pellucid.default_model import ensure_default_model
            model = ensure_default_model()
        PoolerConfig().overridden(pooler_config)      # a bad override fails here, before the engine starts
        self._pooler_override = pooler_config
        self._start(EngineConfig.from_kwargs(model, **engine_kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._pooler_override = None
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.client: EngineCoreClient
        self.client, self.tokenizer = start_engine(config, asynchronous=False)
        self.info: EngineInfo = self.client.info
        self.input_processor = InputProcessor(self.tokenizer, self.info)
        self.output_processor = OutputProcessor(self.tokenizer, self.info.eos_token_ids)
        self._ids = itertools.count()
        self._embedder: Any = None
        self._classifier: Any = None

    @property
    def engine(self) -> EngineCore:
        """The EngineCore, when it runs in this process (engine_process=False, the default)."""
        return self.client.core

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the engine (its process, if it has one). Also done when the interpreter exits."""
        self.client.shutdown()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, extras: Sequence[dict[str, Any] | None] | None = None) -> list[RequestOutput]:
        prompt_list = normalize_prompts(prompts)
        params = self._params_list(sampling_params, len(prompt_list))
        extras_list = list(extras) if extras is not None else [None] * len(prompt_list)
        # Everything is checked before anything is queued. Final-only: generate() returns finished
        # outputs, so the engine reports most requests once, when they end.
        processed = [self.input_processor.process(f"gen-{next(self._ids)}", p, sp, ex, stream=False)
                     for p, sp, ex in zip(prompt_list, params, extras_list)]
        added: set[str] = set()
        try:
            for request in processed:
                self._add(request, stream=False)
                added.add(request.request_id)
        except BaseException:
            self._abort(added)
            raise
        return self._run([r.request_id for r in processed], use_tqdm)

    # ---- step by step, as vLLM's LLMEngine: add_request / step / has_unfinished_requests ----------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    extras: dict[str, Any] | None = None, stream: bool = False) -> None:
        """Queue one request (ValueError, nothing queued, when it is bad). With stream=True, step() reports
        it every time it progresses (cumulative outputs); with stream=False only once, when it finishes."""
        self._add(self.input_processor.process(request_id, prompt, params, extras, stream=stream), stream)

    def abort_request(self, request_id: str) -> None:
        """End a request; its final output (finish_reason "abort") comes from a later step()."""
        self.client.finish_requests(self.output_processor.child_ids(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.client.holds_work()

    def _add(self, request: ProcessedRequest, stream: bool) -> None:
        self.output_processor.add(request.request_id, request.prompt, request.prompt_token_ids, request.params,
                                  request.child_ids, stream=stream, feature_keys=request.feature_keys)
        try:
            send(self.client, request)
        except BaseException:
            self.output_processor.forget(request.request_id)
            raise

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [apply_chat_template(self.tokenizer, conv, add_generation_prompt,
                                       **(chat_template_kwargs or {})) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`output.outputs.embedding`): the final-normed hidden states pooled as the
        model's pooler says (last token, mean or first; normalised or not), see pellucid/pooling/. ValueError
        (nothing queued) for a bad prompt or params; RuntimeError if a request fails in the engine."""
        from pellucid.pooling.embedder import EMBED_SAMPLING, Embedder

        if self._embedder is None:
            self._embedder = Embedder.for_engine(self.info, self._pooler_override)
        embedder = self._embedder
        params = pooling_params if pooling_params is not None else PoolingParams()
        embedder.check(params)
        prompt_list = normalize_prompts(prompts)
        # Truncated before the engine's checks, which then see what is embedded.
        ids = [embedder.prompt_ids(self.input_processor.tokenize(p) if isinstance(p, str) else p, params)
               for p in prompt_list]
        outputs = self.generate(ids, EMBED_SAMPLING, use_tqdm=use_tqdm, extras=[embedder.extras()] * len(ids))
        vectors = embedder.embeddings(outputs, params)
        return [EmbeddingRequestOutput(out.request_id, prompt if isinstance(prompt, str) else None,
                                       out.prompt_token_ids, EmbeddingOutput(vector))
                for prompt, out, vector in zip(prompt_list, outputs, vectors)]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """The class probabilities (and logits) of each prompt, from a sequence-classification model (reward
        models, classifiers: `*ForSequenceClassification` checkpoints), as vLLM's `classify`; see
        pellucid/pooling/classifier.py. ValueError (nothing queued) for another model, a bad prompt or params."""
        classifier = self._get_classifier()
        prompt_list = normalize_prompts(prompts)
        ids = [classifier.prompt_ids(self.input_processor.tokenize(p) if isinstance(p, str) else p, pooling_params)
               for p in prompt_list]
        return self._classified(prompt_list, ids, use_tqdm)

    def _get_classifier(self) -> Any:
        from pellucid.pooling.classifier import Classifier

        if self._classifier is None:
            self._classifier = Classifier.for_engine(self.info)
        return self._classifier

    def _classified(self, prompts: list[Any], ids: list[list[int]], use_tqdm: bool
                    ) -> list[ClassificationRequestOutput]:
        from pellucid.pooling.embedder import EMBED_SAMPLING

        classifier = self._get_classifier()
        outputs = self.generate(ids, EMBED_SAMPLING, use_tqdm=use_tqdm, extras=[classifier.extras()] * len(ids))
        logits = classifier.logits(outputs)
        probs = classifier.probabilities(logits)
        return [ClassificationRequestOutput(out.request_id, prompt if isinstance(prompt, str) else None,
                                            out.prompt_token_ids, ClassificationOutput(p.tolist(), raw.tolist()))
                for prompt, out, p, raw in zip(prompts, outputs, probs, logits)]

    def score(self, text_1: str | list[str], text_2: str | list[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[ScoringRequestOutput]:
        """vLLM's `score`: one text_1 against every text_2, or text_1[i] against text_2[i], in text_2's order.
        An embedding model scores the cosine similarity of the two texts' embeddings; a cross-encoder (a
        classification model with one label) reads each pair as one input (the tokenizer's pair encoding)
        and scores the sigmoid of its logit."""
        from pellucid.pooling.scoring import cosine_scores, pair_up

        pairs = pair_up(text_1, text_2)
        if self.info.num_labels:
            return self._cross_encoder_scores(pairs, truncate_prompt_tokens, use_tqdm)
        texts = list(dict.fromkeys(text for pair in pairs for text in pair))
        outputs = self.embed(texts, PoolingParams(normalize=True, truncate_prompt_tokens=truncate_prompt_tokens),
                             use_tqdm=use_tqdm)
        vectors = {text: out.outputs.data for text, out in zip(texts, outputs)}
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(value))
                for i, value in enumerate(cosine_scores(pairs, vectors))]

    def _cross_encoder_scores(self, pairs: list[tuple[str, str]], truncate_prompt_tokens: int | None,
                              use_tqdm: bool) -> list[ScoringRequestOutput]:
        from pellucid.pooling.classifier import pair_ids

        classifier = self._get_classifier()
        classifier.check_cross_encoder()
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        ids = [classifier.prompt_ids(pair_ids(self.tokenizer, a, b), params) for a, b in pairs]
        results = self._classified([None] * len(ids), ids, use_tqdm)
        return [ScoringRequestOutput(f"score-{i}", ScoringOutput(r.outputs.probs[0])) for i, r in enumerate(results)]

    def trace(self, prompts: PromptType | Sequence[PromptType] | None = None,
              sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Any:
        """`with llm.trace(prompts, params) as tr:` read and edit activations (see docs/tracing.md).
        Default params: greedy, max_tokens=1 (one forward over each prompt)."""
        from pellucid.tracing.api import trace
        return trace(self, prompts, sampling_params)

    def sites(self) -> list[Any]:
        """Every traceable site (`model.layers.0.output`, ..., `logits`, `tokens`) with its per-token shape."""
        return list(self.info.site_table.sites.values())

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

    def step(self) -> list[RequestOutput]:
        """One engine report turned into RequestOutputs: the finished requests, and the streaming ones that
        progressed (stop strings found are sent back to the engine). With the engine in this thread, this
        runs one engine step."""
        outputs = self.client.get_outputs()
        if outputs.engine_error is not None:
            for out in self.output_processor.fail_all(outputs.engine_error):
                logger.error("request %s failed: the engine died", out.request_id)
            raise EngineDeadError(f"the engine core died: {outputs.engine_error}")
        results, stops = self.output_processor.process(outputs.outputs)
        if stops:
            self.client.finish_requests([s.child_id for s in stops], "stop", [s.num_output_tokens for s in stops])
        return results

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Take engine reports until every request in `ids` finished; outputs in the order of `ids`."""
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm or len(ids) < 2,
                   dynamic_ncols=True)
        start, out_tokens = time.monotonic(), 0
        try:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        final[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        if out.error:
                            logger.error("request %s failed: %s", out.request_id, out.error)
                        bar.update(1)
                        bar.set_postfix_str(f"output {out_tokens / max(time.monotonic() - start, 1e-9):.1f} tok/s")
                if pending and self.client.is_idle():
                    raise RuntimeError(f"engine went idle with unfinished requests: {sorted(pending)[:5]}")
        except BaseException:
            self._abort(pending)        # interrupted (Ctrl-C, a failure): the engine drops them too
            raise
        finally:
            bar.close()
        return [final[i] for i in ids]

    def _abort(self, request_ids: set[str]) -> None:
        children = [c for rid in request_ids for c in self.output_processor.child_ids(rid)]
        for rid in request_ids:
            self.output_processor.forget(rid)
        try:
            self.client.finish_requests(children)
        except Exception:
            logger.exception("aborting the unfinished requests failed")
