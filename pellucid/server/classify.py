"""`/classify` (vLLM's) for sequence-classification models (pellucid/pooling/classifier.py):

    {"input": "text" | ["text", ...] | [ids] | [[ids], ...], "truncate_prompt_tokens": n, "add_special_tokens": true}
    -> {"data": [{"index", "label", "probs", "num_classes", "logits"}], "usage": {...}}

`probs` is a softmax over the classes (the sigmoid of a one-label model's logit), `label` the most probable
class's name from config.json's id2label, `logits` the head's raw output (a reward model's reward; an
addition to vLLM's fields). Every input is checked before any is queued; a refused one refuses the request
(HTTP 400 naming the field). The same requests give cross-encoders' /v1/score and /v1/rerank (scores.py).
"""
from __future__ import annotations

import time
import uuid
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pellucid.pooling.classifier import Classifier
from pellucid.pooling.config import PoolingParams
from pellucid.pooling.embedder import EMBED_SAMPLING
from pellucid.server.metrics import RequestTimer
from pellucid.server.protocol import ProtocolError, _Lenient


class ClassificationRequest(_Lenient):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    user: str | None = None


class ClassificationData(BaseModel):
    index: int
    label: str
    probs: list[float]
    num_classes: int
    logits: list[float]


class ClassificationUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ClassificationResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: ClassificationUsage


class ServerClassifications:
    """The endpoint's handler; the model's labels are read on the first request."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self._classifier: Classifier | None = None

    def classifier(self) -> Classifier:
        if self._classifier is None:
            try:
                self._classifier = Classifier.for_engine(self.server.llm.info)
            except ValueError as exc:
                raise ProtocolError(str(exc), param="model") from exc
        return self._classifier

    async def create(self, request: Request) -> JSONResponse:
        server = self.server
        timer = RequestTimer(server.metrics)
        body = await server.parse(request, ClassificationRequest)
        server.check_model(body.model)
        classifier = self.classifier()
        params = _pooling_params(body.truncate_prompt_tokens)
        inputs = self.token_ids(body.input, params, body.add_special_tokens)
        request_id = f"classify-{uuid.uuid4().hex}"
        logits = await self.logits(inputs, request_id, "input")
        probs = classifier.probabilities(logits)
        data = [ClassificationData(index=i, label=classifier.labels[int(p.argmax())], probs=p.tolist(),
                                   num_classes=classifier.num_labels, logits=raw.tolist())
                for i, (p, raw) in enumerate(zip(probs, logits))]
        num_tokens = sum(len(ids) for ids in inputs)
        response = ClassificationResponse(id=request_id, created=int(time.time()), model=server.model_name, data=data,
                                          usage=ClassificationUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        timer.finish("stop")
        return JSONResponse(response.model_dump())

    async def logits(self, inputs: list[list[int]], request_id: str, param: str) -> torch.Tensor:
        """float32 class logits [len(inputs), num_labels] of token id lists, all queued before any is read."""
        classifier = self.classifier()
        finals = await self.server.finals(inputs, EMBED_SAMPLING, request_id, param, extras=classifier.extras())
        return classifier.logits(finals)

    def fitted(self, ids: list[int], params: PoolingParams, what: str, param: str) -> list[int]:
        """`ids` truncated as asked and checked against max_model_len; ProtocolError naming `what`."""
        try:
            return self.classifier().prompt_ids(ids, params)
        except ValueError as exc:
            raise ProtocolError(f"{what}: {exc}", param=param) from exc

    def token_ids(self, raw: Any, params: PoolingParams, add_special_tokens: bool) -> list[list[int]]:
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise ProtocolError("input must not be empty", param="input")
        ids = []
        for i, item in enumerate(raw):
            if isinstance(item, str):
                if not item:
                    raise ProtocolError(f"input[{i}]: the text is empty", param="input")
                item = list(self.server.tokenizer(item, add_special_tokens=add_special_tokens)["input_ids"])
            ids.append(self.fitted(item, params, f"input[{i}]", "input"))     # the engine's checks follow in add_all
        return ids


def _pooling_params(truncate_prompt_tokens: int | None) -> PoolingParams:
    try:
        return PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
    except ValueError as exc:
        raise ProtocolError(str(exc), param="truncate_prompt_tokens") from exc
