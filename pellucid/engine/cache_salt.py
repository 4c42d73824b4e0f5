"""The `cache_salt` request feature (vLLM's name): requests with different salts never share prefix-cache
blocks, e.g. to keep tenants' prompts from probing each other's cache. The KV cache manager mixes the
salt into the first block's hash (kv_cache_manager.py); this module only declares and checks it."""
from __future__ import annotations

from typing import Any

from pellucid.engine.features import RequestFeature, register_feature
from pellucid.engine.request import CACHE_SALT_KEY


class CacheSalt(RequestFeature):
    key = CACHE_SALT_KEY
    step_ahead = True

    def check(self, value: Any, prompt_token_ids: list[int], params: Any, max_total_tokens: int,
              engine_info: Any) -> Any:
        if not isinstance(value, str) or not value:
            raise ValueError(f"cache_salt must be a non-empty string, got {value!r}")
        return value


register_feature(CacheSalt())
