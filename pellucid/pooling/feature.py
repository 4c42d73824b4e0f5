"""The embedding-request marker, `extras["pool"] = <pooling type>`, as a request feature.

It declares that the request never reads its sampled token (`discards_tokens`), so an engine without an LM
head (heads/none.py) serves it, and it holds the request to what an embedding request is: one greedy token,
no logprobs, no constraints. The hidden states themselves come from the trace that rides beside it
(embedder.py); the engine does nothing else for it.
"""
from __future__ import annotations

from typing import Any

from pellucid.engine.features import RequestFeature, register_feature
from pellucid.pooling.config import POOLING_TYPES

POOL_KEY = "pool"


class PoolingMarker(RequestFeature):
    key = POOL_KEY
    step_ahead = True
    discards_tokens = True

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        if value not in POOLING_TYPES:
            raise ValueError(f"extras['pool'] must be one of {', '.join(POOLING_TYPES)}, got {value!r}")
        if (params.n != 1 or params.max_tokens != 1 or params.logprobs is not None or params.prompt_logprobs is not None
                or params.structured_outputs is not None or params.logit_bias or params.allowed_token_ids):
            raise ValueError("an embedding request samples one greedy token that nobody reads: n=1, max_tokens=1, "
                             "no logprobs and no output constraints")
        return value


register_feature(PoolingMarker())
