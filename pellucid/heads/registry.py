"""LM heads by name: the built-ins plus third-party heads from the `pellucid.heads` entry-point group."""
from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import torch

from pellucid.distributed.parallel_state import Shard
from pellucid.heads.base import LMHead
from pellucid.heads.dense import DenseHead
from pellucid.heads.none import NoHead
from pellucid.logger import get_logger

logger = get_logger(__name__)

_HEADS: dict[str, type[LMHead]] = {"dense": DenseHead, "none": NoHead}
ENTRY_POINT_GROUP = "pellucid.heads"


def register_head(name: str, cls: type[LMHead]) -> None:
    if not (isinstance(cls, type) and issubclass(cls, LMHead)):
        raise TypeError(f"head {name!r} must be a subclass of pellucid.heads.base.LMHead, got {cls!r}")
    cls.name = name
    _HEADS[name] = cls


def _load_builtin_and_plugins() -> None:
    if "flashhead" not in _HEADS:
        from pellucid.heads.flashhead.head import FlashHead
        register_head("flashhead", FlashHead)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _HEADS:
            register_head(ep.name, ep.load())


def available_heads() -> list[str]:
    _load_builtin_and_plugins()
    return sorted(_HEADS)


def build_head(name: str, weight: torch.Tensor, options: dict[str, Any], model_dir: str | None = None,
               vocab_shard: Shard | None = None) -> LMHead:
    """`vocab_shard`: `weight` holds this tensor-parallel rank's rows of the vocabulary."""
    _load_builtin_and_plugins()
    if name not in _HEADS:
        raise ValueError(f"unknown LM head {name!r}; available: {', '.join(available_heads())}")
    cls = _HEADS[name]
    if vocab_shard is None:
        head = cls(weight, options, model_dir)
    elif not cls.supports_tensor_parallel:
        raise ValueError(f"the LM head {name!r} does not support tensor parallelism (its class does not declare "
                         "supports_tensor_parallel); use tensor_parallel_size=1 or another head")
    else:
        head = cls(weight, options, model_dir, vocab_shard=vocab_shard)
    logger.info("LM head active: %s", head.describe())
    return head
