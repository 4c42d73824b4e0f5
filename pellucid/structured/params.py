"""StructuredOutputsParams: what a request's output must match, named as in vLLM.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (a Lark grammar in llguidance's dialect)
or `json_object` (any JSON object) is given; `disable_any_whitespace` keeps JSON compact. The constraint compiles to one llguidance grammar, checked when
the request is made: a schema, regex or grammar that cannot compile is refused then, never ignored.
"""
from __future__ import annotations

import functools
import json as json_module
from dataclasses import dataclass
from typing import Any

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # JSON without whitespace between tokens (vLLM's flag): a weak model cannot wander in blank space
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json_module.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs json must be a JSON schema: {exc}") from exc
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object), got {type(self.json).__name__}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs choice must be a non-empty list of non-empty strings, got "
                             f"{self.choice!r}")
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {kind} must be a non-empty string, got {value!r}")

    def grammar_text(self) -> str:
        """The llguidance grammar of the constraint (not yet checked: see check)."""
        from llguidance import LLMatcher
        options = {"whitespace_flexible": False} if self.disable_any_whitespace else None
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json, overrides=options)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            # Lark string literals take JSON's escapes, so each choice is matched exactly, whatever it holds.
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json_module.dumps(c) for c in self.choice))
        assert self.grammar is not None
        return LLMatcher.grammar_from_lark(self.grammar)

    def check(self) -> str:
        """The grammar, compiled once to find errors; ValueError naming the problem. Remembered on this object
        (not a field: it does not travel to an engine in another process), so the frontend and an engine in
        its process compile a request's constraint once."""
        checked = self.__dict__.get("_checked_grammar")
        if checked is not None:
            return checked
        try:
            grammar = self.grammar_text()
        except ValueError as exc:
            raise ValueError(f"structured_outputs cannot compile: {exc}") from exc
        error = _validation_error(grammar)
        if error:
            raise ValueError(f"structured_outputs cannot compile: {error.strip()}")
        self.__dict__["_checked_grammar"] = grammar
        return grammar


@functools.lru_cache(maxsize=256)
def _validation_error(grammar: str) -> str:
    """llguidance's verdict on a grammar ("" when it compiles): the same constraint sent again is not
    recompiled to be checked."""
    from llguidance import LLMatcher
    return LLMatcher.validate_grammar(grammar)
