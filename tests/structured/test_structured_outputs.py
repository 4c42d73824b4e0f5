"""Structured outputs: every output matches its constraint (checked by jsonschema, re and plain membership), greedy
tokens equal a transformers greedy loop masked by the same grammar, and unconstrained requests in the batch are
unchanged; bad constraints are refused before anything is queued."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from transformers import AutoModelForCausalLM

from pellucid import LLM, SamplingParams, StructuredOutputsParams
from pellucid.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "kind", "flags"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                         "kind": {"enum": ["cat", "dog house", "a \"quoted\" one"]},
                         "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                         "note": {"type": "string", "maxLength": 6}}}
REGEX = r"[a-z]{2,6}(-[0-9]{1,3})?@(ab|cd)\.org"
CHOICES = ["yes", "no", "not sure", "{\"a\": 1}"]
GRAMMAR = 'start: "(" item (" " item)* ")"\nitem: /[0-9]/ | "x"'


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=256)


def _constraints() -> list[StructuredOutputsParams]:
    return [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), StructuredOutputsParams(regex=REGEX),
            StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GRAMMAR),
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]


def _check_match(constraint: StructuredOutputsParams, text: str) -> None:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict)
    elif constraint.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif constraint.choice is not None:
        assert text in CHOICES
    else:
        assert re.fullmatch(r"\(([0-9]|x)( ([0-9]|x))*\)", text), text


def _prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1])
def test_outputs_match_their_constraints_and_free_rows_are_unchanged(llm, seed):
    """Greedy and seeded random rows of every kind of constraint in one batch with free rows: each constrained
    output that stopped matches its constraint in full; each free row equals its generation alone."""
    constraints = _constraints()
    params = [SamplingParams(temperature=t, seed=seed * 100 + i, max_tokens=120, structured_outputs=c)
              for i, (t, c) in enumerate((t, c) for t in (0.0, 0.8) for c in constraints)]
    free = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=seed, max_tokens=10, ignore_eos=True)]
    prompts = _prompts(seed, len(params) + len(free))
    outs = llm.generate(prompts, params + free, use_tqdm=False)
    stopped = 0
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        if completion.finish_reason == "stop":
            stopped += 1
            _check_match(p.structured_outputs, completion.text)
        else:
            assert completion.finish_reason == "length"
    assert stopped >= len(params) - 2      # a random model may run out of tokens inside a long JSON number
    for out, prompt, p in zip(outs[len(params):], prompts[len(params):], free):
        alone = llm.generate([prompt], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def _masked_greedy(model_dir: str, prompt: list[int], constraint: StructuredOutputsParams, vocab: int,
                   eos: set[int], max_tokens: int) -> list[int]:
    """transformers' logits, each step masked by an llguidance matcher of the same grammar, argmax; ends where
    the grammar takes nothing more (an EOS is kept), or at max_tokens."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = llguidance.hf.from_tokenizer(load_tokenizer(model_dir), n_vocab=vocab, eos_token=sorted(eos))
    matcher = llguidance.LLMatcher(tokenizer, constraint.check())
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_tokens:
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            tokens.append(token)
            assert matcher.consume_token(token)
            if matcher.is_stopped() or token in eos:
                break
    return tokens


def test_greedy_tokens_equal_transformers_masked_by_the_same_grammar(llm, model_dir):
    vocab = llm.engine.runner.head.vocab_size
    eos = llm.engine.eos_token_ids
    constraints = _constraints()
    prompts = _prompts(5, len(constraints))
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=c) for c in constraints]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, constraint, out in zip(prompts, constraints, outs):
        assert out.outputs[0].token_ids == _masked_greedy(model_dir, prompt, constraint, vocab, eos, 40), constraint


def test_preemption_and_chunked_prefill_keep_the_grammar(model_dir, llm):
    """A KV pool too small for the batch (requests preempted and recomputed) and a small prefill budget give
    the outputs of the roomy engine."""
    constraints = _constraints()
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=60, structured_outputs=c)
              for i, c in enumerate(constraints * 2)]
    prompts = _prompts(9, len(params))
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model_dir, dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=12,
                max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == reference
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("bad,words", [
    (dict(regex="[a-z"), "cannot compile"),
    (dict(json={"type": "nonsense"}), "cannot compile"),
    (dict(json="{not json"), "JSON schema"),
    (dict(grammar="start: undefined_rule"), "cannot compile"),
    (dict(choice=[]), "non-empty list"),
    (dict(regex="a", choice=["a"]), "exactly one"),
    (dict(), "exactly one"),
])
def test_bad_constraints_are_refused_before_queueing(llm, bad, words):
    with pytest.raises(ValueError, match=words):
        llm.generate(["hello"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**bad)),
                     use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_completed_grammar_ends_the_request_even_with_ignore_eos(llm):
    """Once the grammar takes nothing more the request stops, rather than sampling past it."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["done"]))
    out = llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0]
    assert out.text == "done" and out.finish_reason == "stop"


def test_constraints_that_exclude_every_token_end_that_request_only(llm):
    """A grammar whose tokens allowed_token_ids forbids: the request ends with an error naming the cause (no
    token outside its constraints is ever drawn); the request beside it and the engine go on."""
    digits = SamplingParams(temperature=0.8, seed=3, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"),
                            allowed_token_ids=[t for t in range(5, 500) if not llm.tokenizer.decode([t]).strip()
                                               .isdigit()])
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    stuck, fine = llm.generate(["hello", "hello"], [digits, free], use_tqdm=False)
    assert stuck.outputs[0].finish_reason == "error" and stuck.outputs[0].token_ids == []
    assert "no token satisfies the request's constraints" in stuck.error
    assert fine.outputs[0].token_ids == llm.generate(["hello"], free, use_tqdm=False)[0].outputs[0].token_ids
