"""A checkpoint's config.json as plain JSON, for the few fields read before (or without) a transformers config:
parsing it through transformers imports transformers, seconds on some machines."""
from __future__ import annotations

import json
import os
from typing import Any


def read_config_json(model_dir: str) -> dict[str, Any] | None:
    """config.json's fields; None when it is missing or not JSON (the config reader reports that)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
