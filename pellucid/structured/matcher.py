"""A request's place in its grammar (engine side): the tokens it may sample next, as a bitmask, and the
tokens it took.

The matcher lives on the engine's Request (Request.grammar): the scheduler feeds it each sampled token, the
sampling-metadata builder asks all of a step's matchers for their masks at once. Masks depend on the previous
token, so such a request never steps ahead of its readback.
"""
from __future__ import annotations

import functools
from typing import Any

import torch


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """llguidance's view of the tokenizer, over the model's whole vocabulary (a row of the LM head past the
    tokenizer's ids is never allowed); built once per engine tokenizer."""
    import llguidance.hf

    from pellucid.tokenizer import load_tokenizer
    return llguidance.hf.from_tokenizer(load_tokenizer(tokenizer_dir), n_vocab=vocab_size,
                                        eos_token=list(eos_token_ids) or None)


def matcher_for(params: Any, tokenizer_dir: str, vocab_size: int, eos_token_ids: set[int]) -> "GrammarMatcher":
    """The matcher of a request with these SamplingParams (structured_outputs set), for an engine (or a
    tensor-parallel rank) with this tokenizer, vocabulary and EOS ids."""
    compiled = _compiled(params.structured_outputs.check(), tokenizer_dir, vocab_size, tuple(sorted(eos_token_ids)))
    return GrammarMatcher(compiled.deep_copy(), vocab_size)


@functools.lru_cache(maxsize=128)
def _compiled(grammar: str, tokenizer_dir: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """A matcher of `grammar` in its start state, never fed, which requests copy: a copy shares the compiled
    grammar and the lexer states its siblings have built (building one costs ~0.5 ms and its first mask up
    to ~1 ms; a copy ~2 us and a mask the siblings have met ~10 us)."""
    import llguidance
    matcher = llguidance.LLMatcher(grammar_tokenizer(tokenizer_dir, vocab_size, eos_token_ids), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"structured_outputs cannot compile: {matcher.get_error()}")
    return matcher


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


class GrammarMatcher:
    """One request's llguidance matcher (made by matcher_for) over a vocabulary of `vocab_size` tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> str | None:
        """Take a sampled token; the error (the grammar did not allow it) or None."""
        if self._matcher.consume_token(token_id):
            return None
        return f"structured output: the grammar cannot take token {token_id}: {self._matcher.get_error()}"

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no further token (EOS aside)."""
        return self._matcher.is_stopped()

    @property
    def llmatcher(self) -> Any:
        return self._matcher


def fill_bitmasks(matchers: list[GrammarMatcher], pin: bool) -> torch.Tensor:
    """[len(matchers), bitmask_words] int32 on the host (pinned if `pin`, for an asynchronous copy to a GPU):
    row i allows what matcher i may take next. Computed in parallel threads, outside the GIL. A CPU engine
    passes pin=False: pinning would open a CUDA context on a GPU host for an engine that never uses it."""
    import llguidance.torch as lt
    out = torch.empty(len(matchers), bitmask_words(matchers[0].vocab_size), dtype=torch.int32,
                      pin_memory=pin)
    lt.fill_next_token_bitmask_par(_executor(), [(m.llmatcher, i) for i, m in enumerate(matchers)], out)
    return out


@functools.lru_cache(maxsize=1)
def _executor() -> Any:
    import llguidance
    return llguidance.LLExecutor()
