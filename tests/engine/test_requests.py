"""Request-level behaviour of the engine: sampling semantics, stop handling, bad input, n > 1, chat."""
from __future__ import annotations

import json

import pytest
import torch

from pellucid import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_factory) -> LLM:
    return LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu")


def _prompts(llm: LLM, seed: int, lengths: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.engine.runner.head.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_seeded_sampling_is_independent_of_batch_composition(llm):
    target = _prompts(llm, 0, [12])[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = _prompts(llm, 1, [5, 30, 9])
    other_params = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [target] + others[2:], [other_params, other_params, params, other_params],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    unseeded = [llm.generate([target], SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert any(u != alone for u in unseeded)  # seeds matter; without one, draws differ


def test_top_k_one_equals_greedy(llm):
    prompts = _prompts(llm, 2, [8, 20])
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate(prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_n_completions_are_distinct_samples(llm):
    prompt = _prompts(llm, 3, [10])[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.stats().num_used_blocks == 0


def test_n_is_bounded_by_max_num_seqs(tiny_model_factory):
    """Each of the n sequences is an engine request: n above max_num_seqs is refused before anything is queued,
    and n equal to it runs."""
    llm = LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu", max_num_seqs=4)
    prompt = _prompts(llm, 5, [6])[0]
    for n in (5, 2**63):
        with pytest.raises(ValueError, match=f"n must be at most the engine's max_num_seqs \\(4\\), got {n}"):
            llm.generate([prompt], SamplingParams(n=n, max_tokens=2), use_tqdm=False)
        assert not llm.has_unfinished_requests()
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs) == 4


def test_logprobs_are_bounded_by_max_logprobs(llm, tiny_model_factory):
    """As vLLM's max_logprobs (20 by default): more alternatives are refused before anything is queued; with
    -1 a request may have the whole vocabulary, whose probabilities then sum to 1."""
    prompt = _prompts(llm, 6, [7])[0]
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{name} must be at most the engine's max_logprobs \\(20\\), got 21"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
        assert not llm.has_unfinished_requests()
    assert llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20), use_tqdm=False)
    whole = LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu", max_logprobs=-1)
    vocab = whole.engine.runner.head.vocab_size
    out = whole.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, logprobs=vocab), use_tqdm=False)
    for position in out[0].outputs[0].logprobs:
        assert len(position) == vocab
        assert sum(torch.tensor([e.logprob for e in position.values()]).exp()).item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(ValueError, match=f"max_logprobs \\({vocab}\\), got {vocab + 1}"):
        whole.generate([prompt], SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs must be"):
        LLM(tiny_model_factory("qwen3"), dtype="float32", device="cpu", max_logprobs=-2)


def test_max_tokens_and_stop_token_ids(llm):
    prompt = _prompts(llm, 4, [9])[0]
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = base[0].outputs[0].token_ids
    assert len(tokens) == 12 and base[0].outputs[0].finish_reason == "length"
    stop_tok = tokens[5]
    first = tokens.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok


def test_eos_ends_generation(llm):
    prompt = _prompts(llm, 5, [9])[0]
    tokens = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    eos = tokens[3]
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {eos}
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = saved
    assert out.token_ids == tokens[:tokens.index(eos) + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stop_string_spanning_tokens_is_trimmed_exactly(llm, seed):
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"

    def spanning_boundary(sample_seed: int):
        """(text, its prefixes token by token, a token index where a stop string can span two tokens) or None."""
        base = llm.generate([prompt], SamplingParams(temperature=0.7, seed=sample_seed, max_tokens=40,
                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
        pieces = [tok.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
        if base.text != pieces[-1]:
            return None   # a special token, which the output text skips: the pieces would not line up
        # a stop string made of the last character of one token's text and the first of the next one's
        found = next((i for i in range(2, len(pieces) - 1)
                      if pieces[i].startswith(pieces[i - 1]) and pieces[i + 1].startswith(pieces[i])
                      and len(pieces[i - 1]) >= 1 and len(pieces[i]) > len(pieces[i - 1])
                      and "\ufffd" not in pieces[i][len(pieces[i - 1]) - 1:len(pieces[i - 1]) + 1]
                      and "\ufffd" not in pieces[i - 1]), None)
        return None if found is None else (base.text, pieces, found)

    # The first seed (from this one on) whose sample has such a boundary; random bytes often have none.
    seed, (text, pieces, boundary) = next((s, found) for s in range(seed * 100, seed * 100 + 50)
                                          if (found := spanning_boundary(s)) is not None)
    start = len(pieces[boundary - 1]) - 1
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    out = llm.generate([prompt], SamplingParams(temperature=0.7, seed=seed, max_tokens=40, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == expected
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate([prompt], SamplingParams(temperature=0.7, seed=seed, max_tokens=40, ignore_eos=True,
                                                 stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == expected + stop


@pytest.mark.parametrize("bad, message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    # Values the engine's 64-bit messages and torch's generators cannot hold (an HTTP client can send any).
    (dict(seed=2 ** 63), "seed"),
    (dict(seed=-2 ** 63 - 1), "seed"),
    (dict(seed=2 ** 63 - 2, n=3), "seed"),
    (dict(top_k=2 ** 70), "top_k"),
    (dict(max_tokens=2 ** 63), "max_tokens"),
    (dict(logprobs=2 ** 64), "logprobs"),
    (dict(prompt_logprobs=2 ** 64), "prompt_logprobs"),
    (dict(stop_token_ids=[5, 2 ** 64]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    # Past float32's range the sampler's inf would turn masked logits into NaN; NaN fails every bound.
    (dict(temperature=1e308), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(top_p=float("nan")), "top_p"),
])
def test_bad_sampling_params_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


def test_bad_prompts_are_clear_errors_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    too_long = [5] * (llm.engine.max_model_len + 1)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([too_long], use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, 2, 10**9]], use_tqdm=False)
    out = llm.generate(["still serving"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.engine.stats().num_used_blocks == 0


def test_runtime_error_fails_only_that_batch_and_engine_recovers(llm, monkeypatch):
    prompt = _prompts(llm, 6, [6])[0]
    real_launch = llm.engine.runner.launch
    calls = {"n": 0}

    def flaky(so):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return real_launch(so)

    monkeypatch.setattr(llm.engine.runner, "launch", flaky)
    failed = llm.generate([prompt], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert failed.outputs[0].finish_reason == "error" and "injected failure" in failed.error
    ok = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert ok.error is None and len(ok.outputs[0].token_ids) == 3
    assert llm.engine.stats().num_used_blocks == 0


def test_abort_frees_blocks(llm):
    engine = llm.engine
    llm.add_request("to-abort", _prompts(llm, 7, [40])[0], SamplingParams(max_tokens=50, ignore_eos=True))
    llm.step()
    assert engine.stats().num_used_blocks > 0
    llm.abort_request("to-abort")
    assert engine.stats().num_used_blocks == 0     # freed at once, before the next step
    outs = llm.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "to-abort"] == ["abort"]
    assert not llm.has_unfinished_requests() and not engine.has_unfinished_requests()


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = llm.chat(messages, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], use_tqdm=False)


def test_unknown_architecture_is_a_clear_error(tiny_model_factory, tmp_path):
    import shutil
    src = tiny_model_factory("llama")
    dst = tmp_path / "bad-arch"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooBarForCausalLM"):
        LLM(str(dst), device="cpu")


def test_truncated_weights_are_a_clear_error(tiny_model_factory, tmp_path):
    import shutil
    src = tiny_model_factory("llama")
    dst = tmp_path / "truncated"
    shutil.copytree(src, dst)
    weights = next(p for p in dst.iterdir() if p.suffix == ".safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception, match=weights.name):
        LLM(str(dst), device="cpu")


def test_cli_generate_with_default_model(capsys):
    from pellucid.cli import main
    from pellucid.default_model import DEFAULT_MODEL_NAME
    assert main(["generate", "Hello, my name is", "--max-tokens", "5", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    assert DEFAULT_MODEL_NAME in captured.err and "RANDOM" not in captured.err
    assert "--- prompt: 'Hello, my name is'" in captured.out


def test_cli_generate_prints_logprobs(tiny_model_factory, capsys):
    from pellucid.cli import main
    assert main(["generate", "Hello there", "--model", tiny_model_factory("qwen3"), "--max-tokens", "4",
                 "--ignore-eos", "--logprobs", "3", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " logprob " in line]
    assert len(lines) == 4                          # one line per generated token
    assert all("rank" in line and "top:" in line for line in lines)
