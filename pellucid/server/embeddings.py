"""`/v1/embeddings`: OpenAI's embeddings API (and vLLM's extra fields) over the engine's embedding requests
(pellucid/pooling/embedder.py).

    {"input": "text" | ["text", ...] | [ids] | [[ids], ...], "encoding_format": "float" | "base64",
     "dimensions": d, "truncate_prompt_tokens": n, "add_special_tokens": true, "normalize": null}

or, vLLM's chat form, `"messages": [...]` instead of `input` (one embedding of the conversation as the chat
template renders it; `add_generation_prompt` false by default, `continue_final_message`, `chat_template_kwargs`).

Every input is checked before any is queued; a refused one refuses the request (HTTP 400 naming the field).
"base64" is the little-endian float32 bytes of each vector, as the openai client decodes them (it asks for
base64 unless told otherwise).
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import torch
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from pellucid.pooling.config import PoolingParams
from pellucid.pooling.embedder import EMBED_SAMPLING, Embedder
from pellucid.server.metrics import RequestTimer
from pellucid.server.protocol import ChatMessage, ProtocolError, _Lenient


class EmbeddingRequest(_Lenient):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None     # vLLM's chat form: one input, the rendered conversation
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None      # default: True for input, False for messages (the template's)
    normalize: bool | None = None
    add_generation_prompt: bool = False          # with messages
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingData(BaseModel):
    index: int
    object: str = "embedding"
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ServerEmbeddings:
    """The endpoint's handler; the model's pooler is read on the first request (a generation server whose
    model directory describes a pooler it cannot run still serves generation)."""

    def __init__(self, server: Any, pooler_override: dict[str, Any] | str | None) -> None:
        self.server = server
        self.override = pooler_override
        self._embedder: Embedder | None = None

    def embedder(self) -> Embedder:
        if self._embedder is None:
            try:
                self._embedder = Embedder.for_engine(self.server.llm.info, self.override)
            except ValueError as exc:
                raise ProtocolError(f"this model cannot serve embeddings: {exc}", param="model") from exc
        return self._embedder

    async def create(self, request: Request) -> JSONResponse:
        server = self.server
        timer = RequestTimer(server.metrics)
        body = await server.parse(request, EmbeddingRequest)
        server.check_model(body.model)
        embedder = self.embedder()
        try:
            params = PoolingParams(body.dimensions, body.normalize, body.truncate_prompt_tokens)
        except ValueError as exc:
            raise ProtocolError(str(exc), param=str(exc).split(" ", 1)[0]) from exc
        try:
            embedder.check(params)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="dimensions") from exc
        inputs = self.token_ids(body, params)
        request_id = f"embd-{uuid.uuid4().hex}"
        vectors = (await self.embed(inputs, params, request_id, "input")).numpy()
        if body.encoding_format == "base64":
            encoded = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in vectors]
        else:
            encoded = vectors.tolist()
        data = [EmbeddingData(index=index, embedding=row) for index, row in enumerate(encoded)]
        num_tokens = sum(len(ids) for ids in inputs)
        response = EmbeddingResponse(id=request_id, created=int(time.time()), model=server.model_name, data=data,
                                     usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
        timer.finish("stop")        # /metrics: the request's latency and success, as a completion's
        return JSONResponse(response.model_dump())

    async def embed(self, inputs: list[list[int]], params: PoolingParams, request_id: str,
                    param: str) -> torch.Tensor:
        """The float32 embeddings [len(inputs), size] of token id lists, all queued before any is read (a
        refused one refuses them all: ProtocolError naming `param`)."""
        embedder = self.embedder()
        finals = await self.server.finals(inputs, EMBED_SAMPLING, request_id, param, extras=embedder.extras())
        return embedder.embeddings(finals, params)

    def text_ids(self, texts: list[str], params: PoolingParams, param: str, add_special_tokens: bool = True
                 ) -> list[list[int]]:
        """Each text's token ids, truncated as asked and checked against max_model_len; ProtocolError naming
        `param` (and the text's index) otherwise."""
        ids = []
        for i, text in enumerate(texts):
            try:
                if not text:
                    raise ValueError("the text is empty")
                tokens = list(self.server.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
                ids.append(self.embedder().prompt_ids(tokens, params))
            except ValueError as exc:
                raise ProtocolError(f"{param}[{i}]: {exc}", param=param) from exc
        return ids

    def token_ids(self, body: EmbeddingRequest, params: PoolingParams) -> list[list[int]]:
        """Each input's token ids, truncated as asked and checked against max_model_len."""
        if (body.input is None) == (body.messages is None):
            raise ProtocolError("give exactly one of input or messages", param="input")
        if body.messages is not None:
            if body.add_special_tokens:
                raise ProtocolError("add_special_tokens is not supported with messages (the chat template decides "
                                    "the special tokens)", param="add_special_tokens")
            if body.add_generation_prompt and body.continue_final_message:
                raise ProtocolError("add_generation_prompt and continue_final_message exclude each other",
                                    param="continue_final_message")
            ids = self.server.chat_prompt(body, body.messages, continue_final=body.continue_final_message)
            try:
                return [self.embedder().prompt_ids(ids, params)]
            except ValueError as exc:
                raise ProtocolError(f"messages: {exc}", param="messages") from exc
        raw = body.input
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]
        if not raw:
            raise ProtocolError("input must not be empty", param="input")
        if isinstance(raw[0], str):
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            return self.text_ids(raw, params, "input", add_special)       # type: ignore[arg-type]
        ids = []
        for i, item in enumerate(raw):
            try:
                ids.append(self.embedder().prompt_ids(item, params))     # the engine's checks follow in add_all
            except ValueError as exc:
                raise ProtocolError(f"input[{i}]: {exc}", param="input") from exc
        return ids
