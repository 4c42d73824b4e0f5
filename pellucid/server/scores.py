"""`/v1/score` and `/v1/rerank` (vLLM's, and the Jina/Cohere-style rerank body). For an embedding model a pair's
score is the cosine similarity of the two texts' embeddings (pellucid/server/embeddings.py); for a
cross-encoder (a classification model with one label) it is the sigmoid of the model's logit for the pair,
read as one input in the tokenizer's pair encoding (pellucid/server/classify.py).

    /v1/score   {"text_1": str | [str], "text_2": str | [str], "truncate_prompt_tokens": n}
                one text_1 scores against every text_2; otherwise text_1[i] against text_2[i]
    /v1/rerank  {"query": str, "documents": [str | {"text": str}], "top_n": n, "return_documents": true}
                the documents ordered by their score against the query, the best first

Each distinct text is embedded once, and every text is checked before any is queued.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pellucid.pooling.classifier import pair_ids
from pellucid.pooling.config import PoolingParams
from pellucid.pooling.scoring import cosine_scores, pair_up
from pellucid.server.metrics import RequestTimer
from pellucid.server.protocol import ProtocolError, _Lenient


class ScoreRequest(_Lenient):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None


class RerankDocument(_Lenient):
    text: str


class RerankRequest(_Lenient):
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class ScoreData(BaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankResult(BaseModel):
    index: int
    document: dict[str, str] | None = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]


class ServerScores:
    def __init__(self, server: Any) -> None:
        self.server = server

    async def score(self, request: Request) -> JSONResponse:
        timer = RequestTimer(self.server.metrics)
        body = await self.server.parse(request, ScoreRequest)
        self.server.check_model(body.model)
        try:
            pairs = pair_up(body.text_1, body.text_2)
        except ValueError as exc:
            raise ProtocolError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        request_id = f"score-{uuid.uuid4().hex}"
        scores, num_tokens = await self._scores(pairs, body.truncate_prompt_tokens, request_id, ("text_1", "text_2"))
        response = ScoreResponse(id=request_id, created=int(time.time()), model=self.server.model_name,
                                 data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
                                 usage=ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        timer.finish("stop")
        return JSONResponse(response.model_dump())

    async def rerank(self, request: Request) -> JSONResponse:
        timer = RequestTimer(self.server.metrics)
        body = await self.server.parse(request, RerankRequest)
        self.server.check_model(body.model)
        if not body.documents:
            raise ProtocolError("documents must not be empty", param="documents")
        if body.top_n is not None and body.top_n < 1:
            raise ProtocolError(f"top_n must be a positive integer, got {body.top_n}", param="top_n")
        texts = [d if isinstance(d, str) else d.text for d in body.documents]
        request_id = f"rerank-{uuid.uuid4().hex}"
        scores, num_tokens = await self._scores([(body.query, text) for text in texts], body.truncate_prompt_tokens,
                                                request_id, ("query", "documents"))
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[:body.top_n]
        results = [RerankResult(index=i, document={"text": texts[i]} if body.return_documents else None,
                                relevance_score=scores[i]) for i in order]
        response = RerankResponse(id=request_id, model=self.server.model_name, results=results,
                                  usage={"total_tokens": num_tokens})
        timer.finish("stop")
        return JSONResponse(response.model_dump())

    async def _scores(self, pairs: list[tuple[str, str]], truncate: int | None, request_id: str,
                      params: tuple[str, str]) -> tuple[list[float], int]:
        """Each pair's score and the tokens the model read: a cross-encoder's or the embeddings' cosine."""
        try:
            pooling = PoolingParams(normalize=None if self.server.llm.info.num_labels else True,
                                    truncate_prompt_tokens=truncate)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="truncate_prompt_tokens") from exc
        if self.server.llm.info.num_labels:
            return await self._cross_encoded(pairs, pooling, request_id, params)
        return await self._cosines(pairs, pooling, request_id, params)

    async def _cross_encoded(self, pairs: list[tuple[str, str]], pooling: PoolingParams, request_id: str,
                             params: tuple[str, str]) -> tuple[list[float], int]:
        """The cross-encoder's probability for each pair, and the tokens it read."""
        classifications = self.server.classifications
        classifier = classifications.classifier()
        try:
            classifier.check_cross_encoder()
        except ValueError as exc:
            raise ProtocolError(str(exc), param="model") from exc
        ids = []
        for i, (first, second) in enumerate(pairs):
            if not first or not second:
                raise ProtocolError(f"{params[0] if not first else params[1]}: a text is empty",
                                    param=params[0] if not first else params[1])
            ids.append(classifications.fitted(pair_ids(self.server.tokenizer, first, second), pooling,
                                              f"{params[1]}[{i}]", params[1]))
        logits = await classifications.logits(ids, request_id, params[1])
        return classifier.probabilities(logits)[:, 0].tolist(), sum(len(i) for i in ids)

    async def _cosines(self, pairs: list[tuple[str, str]], pooling: PoolingParams, request_id: str,
                       params: tuple[str, str]) -> tuple[list[float], int]:
        """The cosine similarity of each pair's embeddings, and the tokens embedded (each side's distinct texts
        once)."""
        embeddings = self.server.embeddings
        left = list(dict.fromkeys(a for a, _ in pairs))
        right = list(dict.fromkeys(b for _, b in pairs))
        ids = embeddings.text_ids(left, pooling, params[0]) + embeddings.text_ids(right, pooling, params[1])
        vectors = await embeddings.embed(ids, pooling, request_id, params[1])
        keyed = {("l", text): vectors[i] for i, text in enumerate(left)}
        keyed.update({("r", text): vectors[len(left) + i] for i, text in enumerate(right)})
        return cosine_scores([(("l", a), ("r", b)) for a, b in pairs], keyed), sum(len(i) for i in ids)
