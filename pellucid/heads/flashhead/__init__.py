"""FlashHead: a clustered, retrieval-style LM head, registered as head "flashhead"."""
from pellucid.heads.flashhead.head import FlashHead
from pellucid.heads.registry import register_head

register_head("flashhead", FlashHead)

__all__ = ["FlashHead"]
