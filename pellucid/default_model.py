"""The embedded default model: a small random-weight Qwen3-style model with a real BPE tokenizer.

Built deterministically, offline, into a cache directory on first use. Its weights are random, so its
text is gibberish; it exists so that `pellucid generate "..."` works on a fresh machine with no hub access.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from pellucid.logger import get_logger

logger = get_logger(__name__)

DEFAULT_MODEL_NAME = "pellucid-default-qwen3-random-v1"
DEFAULT_MODEL_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, max_position_embeddings=2048)


def default_cache_dir() -> str:
    root = os.environ.get("PELLUCID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pellucid")
    return os.path.join(root, DEFAULT_MODEL_NAME)


def ensure_default_model() -> str:
    """Directory of the default model, building it on first use (atomically: build aside, then rename)."""
    target = default_cache_dir()
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    from pellucid.tiny_models import build_tiny_model

    os.makedirs(os.path.dirname(target), exist_ok=True)
    logger.info("building the embedded default model (random weights, not trained) into %s", target)
    tmp = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(target))
    try:
        build_tiny_model("qwen3", tmp, seed=0, **DEFAULT_MODEL_CONFIG)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def is_default_model(path: str) -> bool:
    return os.path.abspath(path) == os.path.abspath(default_cache_dir())
