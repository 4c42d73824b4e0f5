"""Extraction inputs: normalize data records, tokenize them, and compute the assistant loss mask.

A sample is a prompt string, a list of token ids, a chat conversation (a list of {"role", "content"}
messages), or a record {"id"?, "prompt" | "prompt_token_ids" | "messages"}. Samples without an id are
named by their position in the data ("0", "1", ...), so a resumed job must see the same data order.

Loss mask (chat data): 1 on the tokens the assistant produces, 0 elsewhere.
- If the chat template marks assistant text with `{% generation %}` blocks, the mask is the
  tokenizer's own `assistant_masks` (transformers' `return_assistant_tokens_mask`).
- Otherwise it is derived by rendering message prefixes: for each assistant message i, the assistant's
  tokens are those whose text lies between the render of messages[:i] with the generation prompt and
  the render of messages[:i+1] (content plus the end-of-turn markup the template adds after it). The
  template must be prefix-consistent (each of those renders is a prefix of the full render); if it
  is not (e.g. a template that rewrites earlier turns), the sample fails with a clear error rather than
  getting a wrong mask.
With `generate`, every generated response token is an assistant token (mask 1), for plain prompts too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

_RECORD_KEYS = ("prompt", "prompt_token_ids", "messages")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class RawSample:
    sample_id: str
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None


@dataclass
class Sample:
    sample_id: str
    token_ids: list[int]                  # what the engine runs (the prompt when generating)
    loss_mask: list[int] | None           # over token_ids; None for plain prompts
    is_chat: bool


def _is_message(item: Any) -> bool:
    return isinstance(item, dict) and "role" in item and "content" in item


def _is_token_list(item: Any) -> bool:
    return isinstance(item, (list, tuple)) and bool(item) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in item)


def iter_raw_samples(data: Any) -> Iterator[RawSample]:
    """RawSamples with ids, lazily (data may be a generator). ValueError naming the bad item."""
    if isinstance(data, str) or _is_token_list(data):
        data = [data]
    elif isinstance(data, dict):
        raise ValueError("data must be an iterable of samples; wrap a single record in a list")
    elif isinstance(data, (list, tuple)) and data and _is_message(data[0]):
        raise ValueError("data looks like one conversation (a list of messages); pass a list of "
                         "conversations: [messages]")
    if not isinstance(data, Iterable):
        raise ValueError(f"data must be an iterable of samples, got {type(data).__name__}")
    seen: set[str] = set()
    for index, item in enumerate(data):
        sample = _raw_sample(index, item)
        if sample.sample_id in seen:
            raise ValueError(f"sample id {sample.sample_id!r} appears twice in the data; ids must be unique")
        seen.add(sample.sample_id)
        yield sample


def _raw_sample(index: int, item: Any) -> RawSample:
    where = f"data[{index}]"
    sample_id = str(index)
    if isinstance(item, dict) and not _is_message(item):
        if "id" in item:
            if not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool) or str(item["id"]) == "":
                raise ValueError(f"{where}: id must be a non-empty string or an integer, got {item['id']!r}")
            sample_id = str(item["id"])
        present = [k for k in _RECORD_KEYS if k in item]
        if len(present) != 1:
            raise ValueError(f"{where}: a record needs exactly one of {', '.join(_RECORD_KEYS)} (got keys "
                             f"{sorted(item)})")
        key = present[0]
        item = item[key]
        if key == "prompt" and not isinstance(item, str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        if key == "prompt_token_ids" and not _is_token_list(item):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of integers")
        if key == "messages" and not (isinstance(item, list) and item and all(_is_message(m) for m in item)):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    if isinstance(item, str):
        if not item:
            raise ValueError(f"{where}: the prompt is empty")
        return RawSample(sample_id, prompt=item)
    if _is_token_list(item):
        return RawSample(sample_id, token_ids=list(item))
    if isinstance(item, list) and item and all(_is_message(m) for m in item):
        return RawSample(sample_id, messages=item)
    raise ValueError(f"{where}: expected a prompt string, a list of token ids, a list of messages or a record "
                     f"with one of {', '.join(_RECORD_KEYS)}; got {type(item).__name__}")


def tokenize_sample(raw: RawSample, tokenizer: Any, generate: bool) -> Sample:
    """Token ids (and the loss mask for chat data). With `generate` a conversation is rendered with the
    generation prompt (the response comes from the model), else as it is (its assistant turns included)."""
    if raw.messages is not None:
        try:
            ids, mask = chat_tokens_and_mask(tokenizer, raw.messages, add_generation_prompt=generate)
        except ValueError:
            raise
        except Exception as exc:  # jinja errors (a template that rejects a role or their order)
            raise ValueError(f"the chat template failed on this conversation: {type(exc).__name__}: {exc}") from exc
        return Sample(raw.sample_id, ids, mask, is_chat=True)
    if raw.prompt is not None:
        ids = list(tokenizer(raw.prompt)["input_ids"])
        if not ids:
            raise ValueError("the prompt tokenizes to no tokens")
        return Sample(raw.sample_id, ids, None, is_chat=False)
    assert raw.token_ids is not None
    return Sample(raw.sample_id, list(raw.token_ids), None, is_chat=False)


def chat_tokens_and_mask(tokenizer: Any, messages: list[dict[str, Any]],
                         add_generation_prompt: bool) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and the mask of its assistant tokens (see module doc)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("chat data needs a chat template, and this model's tokenizer has none")
    if _GENERATION_BLOCK.search(template):
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), [int(m) for m in rendered["assistant_masks"]]
    return _mask_by_prefix_renders(tokenizer, messages, add_generation_prompt)


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def _mask_by_prefix_renders(tokenizer: Any, messages: list[dict[str, Any]],
                            add_generation_prompt: bool) -> tuple[list[int], list[int]]:
    full = _render(tokenizer, messages, add_generation_prompt)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True) if i else ""
        through = _render(tokenizer, messages[:i + 1], False)
        if not through.startswith(before) or not full.startswith(through):
            raise ValueError(f"the chat template is not prefix-consistent at message {i} (rendering a prefix of the "
                             f"conversation does not give a prefix of the full render), so the assistant loss mask "
                             f"cannot be derived; use a template with {{% generation %}} blocks")
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = []
    for start, end in encoded["offset_mapping"]:
        inside = any(lo <= start < hi for lo, hi in spans) if end > start else False
        mask.append(int(inside))
    return ids, mask
