"""The server through the official openai client, checked against LLM.generate and transformers."""
from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pellucid.sampling_params import SamplingParams
from server_harness import ENGINE_KWARGS, MODEL_NAME, random_prompts


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(server_model_dir):
    model = AutoModelForCausalLM.from_pretrained(server_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(server_model_dir)


def by_index(choices):
    return sorted(choices, key=lambda c: c.index)


@pytest.mark.parametrize("seed", [0, 1])
def test_completions_greedy_equal_llm_generate_with_right_usage(client, reference_llm, hf, seed):
    prompts = random_prompts(seed, 4)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10, temperature=0)
    refs = reference_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    choices = by_index(resp.choices)
    assert [c.text for c in choices] == [r.outputs[0].text for r in refs]
    assert [c.finish_reason for c in choices] == [r.outputs[0].finish_reason for r in refs]
    tokenizer = hf[1]
    prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    completion_tokens = sum(len(r.outputs[0].token_ids) for r in refs)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.completion_tokens == completion_tokens
    assert resp.usage.total_tokens == prompt_tokens + completion_tokens
    assert resp.model == MODEL_NAME


@pytest.mark.parametrize("seed", [2, 3])
def test_completion_stream_concatenates_to_the_non_streamed_text(client, seed):
    prompt = random_prompts(seed, 1)[0]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].text
    assert finish == full.choices[0].finish_reason
    assert usage == full.usage


@pytest.mark.parametrize("seed", [4, 5])
def test_chat_equals_llm_chat_streamed_and_not(client, reference_llm, seed):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": random_prompts(seed, 1)[0]}]
    ref = reference_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert full.usage.completion_tokens == len(ref.outputs[0].token_ids)
    pieces, roles, usage = [], [], None
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            pieces.append(choice.delta.content or "")
    assert roles == ["assistant"]
    assert "".join(pieces) == ref.outputs[0].text
    assert usage == full.usage


def test_multi_turn_chat_uses_the_template_with_all_roles(client, reference_llm):
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "the cat"}, {"role": "user", "content": "sat on a mat"}]
    ref = reference_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_token_id_prompts_and_seeded_n(client, reference_llm, hf):
    ids = hf[1]("the quick brown fox")["input_ids"]
    resp = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    ref = reference_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)

    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8)
    ref = reference_llm.generate(["hello world"], params, use_tqdm=False)[0]
    resp = client.completions.create(model=MODEL_NAME, prompt="hello world", n=3, temperature=1.0, seed=11,
                                     max_tokens=8)
    assert [c.index for c in by_index(resp.choices)] == [0, 1, 2]
    assert [c.text for c in by_index(resp.choices)] == [c.text for c in ref.outputs]
    assert resp.usage.completion_tokens == sum(len(c.token_ids) for c in ref.outputs)


def test_stop_string_is_honoured_streamed_and_not(client):
    prompt = "the cat sat on a mat"
    base = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 2]
    assert stop
    expected = base[:base.find(stop)]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    resp = client.completions.create(**kwargs)
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == expected


def test_completion_logprobs_match_transformers(client, reference_llm, hf):
    model, tokenizer = hf
    prompt = "hello world the quick"
    k = 3
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=k,
                                     extra_body={"ignore_eos": True})
    ref = reference_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                 use_tqdm=False)[0]
    generated = ref.outputs[0].token_ids
    ids = torch.tensor([ref.prompt_token_ids + generated])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = range(len(ref.prompt_token_ids) - 1, ids.shape[1] - 1)
    lp = resp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(generated)
    for j, (pos, tid) in enumerate(zip(positions, generated)):
        assert lp.token_logprobs[j] == pytest.approx(logprobs[pos, tid].item(), abs=1e-4)
        assert lp.tokens[j] == tokenizer.decode([tid])
        top_ids = torch.topk(logprobs[pos], k).indices.tolist()
        for tid_alt in top_ids:
            text = tokenizer.decode([tid_alt])
            assert lp.top_logprobs[j][text] == pytest.approx(logprobs[pos, tid_alt].item(), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(lp.tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_transformers(client, hf, stream):
    """echo + logprobs (how scoring harnesses such as lm-evaluation-harness read a prompt's loglikelihood):
    the prompt's tokens come first, the first without a logprob, then the generated ones; logprobs and top
    alternatives equal transformers', with n = 2 and two prompts."""
    model, tokenizer = hf
    prompts, k, n = ["the quick brown fox jumps", "hello world"], 2, 2
    merged, _ = _merged_completion_choices(client, stream, model=MODEL_NAME, prompt=prompts, max_tokens=3,
                                           temperature=0, logprobs=k, echo=True, n=n, extra_body={"ignore_eos": True})
    merged = {index: choice[:-1] for index, choice in merged.items()}
    assert sorted(merged) == list(range(len(prompts) * n))
    for index, (text, *logprobs) in merged.items():
        prompt = prompts[index // n]
        prompt_ids = tokenizer(prompt)["input_ids"]
        assert text.startswith(prompt)
        scored = list(prompt_ids)
        with torch.no_grad():
            for _ in range(3):      # transformers' own greedy continuation (temperature 0)
                scored.append(int(model(torch.tensor([scored])).logits[0, -1].argmax()))
        _check_echo_logprobs(*logprobs, scored, hf, k)


def _merged_completion_choices(client, stream, **kwargs):
    """Per choice index (text, tokens, token_logprobs, top_logprobs, text_offset, finish_reason), the chunks of a
    streamed response joined."""
    if not stream:
        resp = client.completions.create(**kwargs)
        return {c.index: (c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs,
                          c.logprobs.text_offset, c.finish_reason) for c in resp.choices}, resp.usage
    choices: dict[int, list] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for c in chunk.choices:
            choices.setdefault(c.index, []).append(c)
    merged = {}
    for index, parts in choices.items():
        lps = [c.logprobs for c in parts if c.logprobs is not None]
        merged[index] = ("".join(c.text for c in parts), [t for lp in lps for t in lp.tokens],
                         [x for lp in lps for x in lp.token_logprobs], [x for lp in lps for x in lp.top_logprobs],
                         [x for lp in lps for x in lp.text_offset], parts[-1].finish_reason)
    return merged, usage


def _check_echo_logprobs(tokens, token_logprobs, top_logprobs, offsets, scored, hf, k):
    """Legacy completions logprobs of the token ids `scored` (prompt first) against transformers': the first
    token has none, then each token's logprob and the top k alternatives; offsets count characters."""
    model, tokenizer = hf
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([scored])).logits[0].float(), dim=-1)
    assert tokens == [tokenizer.decode([t]) for t in scored]
    assert token_logprobs[0] is None and top_logprobs[0] is None
    for pos in range(1, len(tokens)):
        tid = scored[pos]
        assert token_logprobs[pos] == pytest.approx(reference[pos - 1, tid].item(), abs=1e-4)
        candidates = list(dict.fromkeys([tid] + torch.topk(reference[pos - 1], k).indices.tolist()))
        texts = [tokenizer.decode([c]) for c in candidates]
        for alt, alt_text in zip(candidates, texts):
            if texts.count(alt_text) == 1:      # keyed by text: two tokens that decode alike share a key
                assert top_logprobs[pos][alt_text] == pytest.approx(reference[pos - 1, alt].item(), abs=1e-4)
    assert offsets == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_no_tokens_returns_the_scored_prompt_only(client, hf, stream):
    """OpenAI's echo with max_tokens 0 (lm-evaluation-harness style: token-id prompts, logprobs): each choice is
    its prompt alone, scored as transformers scores it, finished for length, with no completion tokens counted;
    without logprobs the text alone; min_tokens cannot be asked for with it."""
    tokenizer = hf[1]
    rng = random.Random(7 + stream)
    prompts = [[rng.randrange(5, tokenizer.vocab_size) for _ in range(rng.randrange(3, 12))] for _ in range(3)]
    k, n = 3, 2
    merged, usage = _merged_completion_choices(client, stream, model=MODEL_NAME, prompt=prompts, max_tokens=0,
                                               echo=True, logprobs=k, n=n, temperature=0.7)
    assert sorted(merged) == list(range(len(prompts) * n))
    for index, (text, tokens, token_logprobs, top_logprobs, offsets, finish) in merged.items():
        prompt = prompts[index // n]
        assert text == tokenizer.decode(prompt) and finish == "length"
        _check_echo_logprobs(tokens, token_logprobs, top_logprobs, offsets, prompt, hf, k)
    assert usage.completion_tokens == 0 and usage.prompt_tokens == usage.total_tokens == sum(map(len, prompts))
    plain = client.completions.create(model=MODEL_NAME, prompt="the quick brown fox", max_tokens=0, echo=True,
                                      stream=stream)
    choices = [c for chunk in plain for c in chunk.choices] if stream else plain.choices
    assert "".join(c.text for c in choices) == "the quick brown fox"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0, echo=True,
                                  extra_body={"min_tokens": 1})
    assert refused.value.body["param"] == "min_tokens"


def _check_prompt_logprobs(scored, prompt_ids, model, k):
    """vLLM's prompt_logprobs against transformers: None first, then per position the prompt token's logprob and
    rank and the top k alternatives."""
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for pos in range(1, len(prompt_ids)):
        entries = {int(t): e for t, e in scored[pos].items()}
        row = reference[pos - 1]
        expected = set(torch.topk(row, k).indices.tolist()) | {prompt_ids[pos]}
        assert set(entries) == expected
        for tid, entry in entries.items():
            assert entry["logprob"] == pytest.approx(row[tid].item(), abs=1e-4)
            assert entry["rank"] == int((row > row[tid]).sum()) + 1


def test_prompt_logprobs_equal_transformers(server, hf):
    """vLLM's `prompt_logprobs` extension on both endpoints (the chat prompt through its template); refused
    when streaming."""
    model, tokenizer = hf
    k = 3
    body = {"model": MODEL_NAME, "prompt": "the quick brown fox jumps over", "max_tokens": 2, "prompt_logprobs": k,
            "n": 2, "temperature": 0.8, "seed": 3}
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    _check_prompt_logprobs(choices[0]["prompt_logprobs"], tokenizer(body["prompt"])["input_ids"], model, k)
    messages = [{"role": "user", "content": "what is the brown fox?"}]
    chat = httpx.post(f"{server.base_url}/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    _check_prompt_logprobs(chat.json()["prompt_logprobs"], prompt_ids, model, 0)
    streamed = httpx.post(f"{server.base_url}/completions", json=dict(body, stream=True), timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_chat_logprobs_streamed_equal_non_streamed(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "the brown fox"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(full) >= 1
    for entry in full:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    streamed = [e for c in client.chat.completions.create(stream=True, **kwargs)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in full]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in full], abs=1e-4)


def test_models_health_version_tokenize_detokenize(server, client, hf):
    tokenizer = hf[1]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    text = " ".join(random_prompts(9, 3))
    tok = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    assert tok["tokens"] == tokenizer(text)["input_ids"]
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == ENGINE_KWARGS["max_model_len"]
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == tokenizer.decode(tok["tokens"])
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert chat["tokens"] == list(expected)


def test_logit_bias_and_allowed_token_ids_equal_llm_generate(client, reference_llm, hf):
    """OpenAI's logit_bias (string token-id keys) on both endpoints and vLLM's allowed_token_ids (extra_body) give
    LLM.generate's tokens with the same parameters; bad values are 400s naming the field."""
    tokenizer = hf[1]
    rng = random.Random(5)
    ids = rng.sample(range(5, tokenizer.vocab_size), 40)
    bias = {t: rng.uniform(-8, 8) for t in ids[:20]}
    allowed = ids[15:40]
    prompt = random_prompts(9, 1)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                         logit_bias={str(t): b for t, b in bias.items()},
                                         extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
    reference = reference_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                logit_bias=bias, allowed_token_ids=allowed),
                                       use_tqdm=False)[0].outputs[0]
    assert response.choices[0].text == reference.text
    assert set(reference.token_ids) <= set(allowed)
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                          logit_bias={str(ids[0]): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tokenizer.decode([ids[0]] * 6)
    vocab = reference_llm.engine.runner.head.vocab_size
    for field, value in (("logit_bias", {"12": 101}), ("logit_bias", {"twelve": 1}), ("logit_bias", {str(vocab): 1}),
                         ("allowed_token_ids", []), ("allowed_token_ids", [vocab + 3]), ("stop_token_ids", [vocab])):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={field: value})
        assert refused.value.body["param"] == field, (field, value)


def test_structured_outputs_on_both_endpoints(client, server, hf):
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and guided_choice: each
    finished output matches its constraint; a constraint that cannot compile, or two at once, is a 400 naming
    the field."""
    import json
    import re

    import jsonschema
    import llguidance
    import llguidance.hf

    from pellucid import StructuredOutputsParams
    schema = {"type": "object", "required": ["n", "ok"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}
    messages = [{"role": "user", "content": "give me json"}]
    tokenizer = hf[1]

    def follows(constraint: StructuredOutputsParams, text: str) -> bool:
        """The text is a prefix the constraint's grammar accepts (a random model may run out of tokens inside
        flexible JSON whitespace)."""
        matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer), constraint.check())
        return matcher.consume_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0.7, n=3, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    for choice in chat.choices:
        assert follows(StructuredOutputsParams(json=schema), choice.message.content), choice.message.content
        assert not follows(StructuredOutputsParams(json={"type": "array"}), choice.message.content)
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    compact = client.completions.create(model=MODEL_NAME, prompt="json:", max_tokens=80, temperature=0.5, seed=3,
                                        extra_body={"structured_outputs": {"json": schema,
                                                                           "disable_any_whitespace": True}})
    assert compact.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(compact.choices[0].text), schema)
    anything = client.completions.create(model=MODEL_NAME, prompt="json:", max_tokens=30, temperature=0.5, seed=3,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert follows(StructuredOutputsParams(json_object=True), anything.choices[0].text)
    regex = r"[a-z]{3,6}-[0-9]{2}"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="code:", max_tokens=20, temperature=0.8, seed=1, stream=True,
        extra_body={"structured_outputs": {"regex": regex}}) if c.choices)
    assert re.fullmatch(regex, streamed), streamed
    picked = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=1.0,
                                            extra_body={"guided_choice": ["red", "green", "blue"]})
    assert picked.choices[0].message.content in ("red", "green", "blue")
    for body, param in (({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
                        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")):
        response = httpx.post(f"{server.base_url}/completions", timeout=30,
                              json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (body, response.text)


def test_streamed_text_offsets_equal_the_non_streamed_ones(client):
    """text_offset counts the tokens' own texts, streamed or not, also where a token ends mid-character (the
    streamed text then lags the tokens: here 'é' is two byte tokens, held to by a regex)."""
    kwargs = dict(model=MODEL_NAME, prompt="accents:", max_tokens=8, temperature=0, logprobs=1,
                  extra_body={"structured_outputs": {"regex": "(é|ü){4}"}})
    whole = client.completions.create(**kwargs).choices[0]
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert len(whole.logprobs.tokens) > 4 and text == whole.text
    assert (tokens, offsets) == (whole.logprobs.tokens, whole.logprobs.text_offset)
