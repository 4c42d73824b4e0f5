"""Reasoning outputs on /v1/chat/completions: a thinking model's `<think>...</think>` comes back apart from its
answer, in the message's `reasoning` field (vLLM's name since it renamed `reasoning_content`), when the server
runs with --reasoning-parser.

- "qwen3": reasoning only where the answer opens with `<think>` (a model whose thinking is off answers
  directly, and all of it is content).
- "deepseek_r1": the chat template may already have opened `<think>` in the prompt, so the answer is
  reasoning from its first token until `</think>`.

An answer that ends (max_tokens) before `</think>` is all reasoning. Parsers are registered by name
(REASONING_PARSERS).
"""
from __future__ import annotations

from pellucid.server.parser_registry import ParserRegistry
from pellucid.server.tool_parsers import held_back


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    start_in_prompt = False      # the reasoning may start without its start tag (it was in the prompt)

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the answer so far. Unfinished, a tail that may begin a tag is in neither
        yet (it is decided by the next tokens), so what each holds only grows."""
        if text.startswith(self.start_tag):
            body = text[len(self.start_tag):]
        elif not finished and self.start_tag.startswith(text):
            return "", ""            # maybe the start tag, not complete yet
        elif self.start_in_prompt:
            body = text
        else:
            return "", text
        end = body.find(self.end_tag)
        if end != -1:
            return body[:end], body[end + len(self.end_tag):]
        if finished:
            return body, ""
        return body[:len(body) - held_back(body, self.end_tag)], ""


REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning parser")


@REASONING_PARSERS.register
class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


@REASONING_PARSERS.register
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    start_in_prompt = True
