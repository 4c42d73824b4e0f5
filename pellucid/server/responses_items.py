"""A stored response's input items: kept with ids (`GET /v1/responses/{id}/input_items` lists them), and found
again by id when a later request's input holds an `{"type": "item_reference", "id": ...}`."""
from __future__ import annotations

import json
from typing import Any, Callable

from pellucid.server.protocol import ProtocolError
from pellucid.server.responses_output import new_item_id

# The id prefix OpenAI gives each kind of item.
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON-safe copies of input items as the input_items list shows them: each with an id, and a message's text
    as content parts (input_text, or output_text for an assistant's)."""
    listed = []
    for item in json.loads(json.dumps(items)):
        kind = item.setdefault("type", "message")
        item.setdefault("id", new_item_id(_ID_PREFIXES.get(kind, "item")))
        if kind == "message":
            content = item.get("content")
            part_type = "output_text" if item.get("role") == "assistant" else "input_text"
            if isinstance(content, str):
                part = {"type": part_type, "text": content}
                if part_type == "output_text":
                    part["annotations"] = []
                item["content"] = [part]
            item.setdefault("status", "completed")
        listed.append(item)
    return listed


def resolve_references(items: list[dict[str, Any]], find: Callable[[str], dict[str, Any] | None]
                       ) -> list[dict[str, Any]]:
    """`items` with each item_reference replaced by the stored item it names (`find(id)`, None when unknown)."""
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            item_id = item.get("id")
            found = find(item_id) if isinstance(item_id, str) else None
            if found is None:
                raise ProtocolError(f"input.{i} refers to item {item_id!r}, which no stored response holds (never "
                                    f"stored, deleted, or evicted)", param=f"input.{i}.id")
            item = json.loads(json.dumps(found))
        resolved.append(item)
    return resolved


def page(items: list[dict[str, Any]], order: str, after: str | None, limit: int) -> dict[str, Any]:
    """One page of the input_items list: `limit` items in `order` ("asc": as given, "desc": newest first),
    starting after the item with id `after`."""
    if order not in ("asc", "desc"):
        raise ProtocolError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
    if not 1 <= limit <= 100:
        raise ProtocolError(f"limit must be in [1, 100], got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise ProtocolError(f"after names no item of this response: {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}
