"""FlashHead: a clustered, retrieval-style LM head, the built-in head "flashhead" (pellucid.heads.registry).

`FlashHead` loads with its module on first use, so `pellucid flashhead --help` (whose parser lives in
pellucid.heads.flashhead.cli) does not import torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["FlashHead"]


def __getattr__(name: str) -> Any:
    if name != "FlashHead":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from pellucid.heads.flashhead.head import FlashHead
    return FlashHead
