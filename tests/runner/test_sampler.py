"""Sampler and sampling-metadata builder against brute-force references on random logits."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from scipy.stats import chisquare

from pellucid.engine.request import Request
from pellucid.runner.sampler import NO_TOKEN, Sampler, gather_logprobs
from pellucid.runner.sampling_metadata import SamplingMetadata
from pellucid.runner.sampling_metadata_builder import build_sampling_metadata
from pellucid.sampling_params import SamplingParams

VOCAB = 500
EOS = 3
SEEDS = [0, 1, 2]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs CUDA"))]
sampler = Sampler()


def make_request(request_id: str, params: SamplingParams, rng: torch.Generator, prompt_len: int = 12,
                 num_outputs: int = 0) -> Request:
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=rng).tolist()
    request = Request(request_id, prompt, params, eos_token_ids={EOS})
    for token in torch.randint(0, VOCAB, (num_outputs,), generator=rng).tolist():
        request.append_output_token(token)
    return request


def random_logits(rows: int, rng: torch.Generator, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=rng) * scale


def uniform_metadata(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     min_p: float = 0.0) -> SamplingMetadata:
    """Every row with the same parameters, built directly (independent of the builder)."""
    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype)
    return SamplingMetadata(
        temperature=full(temperature), top_p=full(top_p), top_k=full(top_k, torch.int64), min_p=full(min_p),
        presence_penalty=full(0.0), frequency_penalty=full(0.0), repetition_penalty=full(1.0),
        all_greedy=temperature == 0, all_random=temperature > 0, no_top_p=top_p == 1.0, no_top_k=top_k == 0,
        no_min_p=min_p == 0.0, no_penalties=True)


def brute_force_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    params = request.sampling_params
    out = logits.double().clone()
    for token in set(request.prompt_token_ids) | set(request.output_token_ids):
        value = out[token].item()
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token in set(request.output_token_ids):
        count = request.output_token_ids.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def brute_force_allowed(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens a random row may sample: min-p, then top-k, then top-p over the renormalised survivors."""
    probs = torch.softmax(logits.double() / params.temperature, dim=0).tolist()
    top = max(probs)
    survivors = [t for t, p in enumerate(probs) if p >= params.min_p * top]
    survivors.sort(key=lambda t: -probs[t])
    if params.top_k > 0:
        survivors = survivors[:params.top_k]
    total = sum(probs[t] for t in survivors)
    allowed, mass_above = set(), 0.0
    for token in survivors:
        if mass_above < params.top_p:
            allowed.add(token)
        mass_above += probs[token] / total
    return allowed


def run_steps(requests: list[Request], logits_for: dict[str, list[torch.Tensor]], steps: int,
              device: str, order_for_step=None) -> dict[str, list[tuple]]:
    """Sample `steps` tokens for every request, appending each to its request as the engine would."""
    history: dict[str, list[tuple]] = {r.request_id: [] for r in requests}
    for step in range(steps):
        batch = order_for_step(step) if order_for_step else requests
        logits = torch.stack([logits_for[r.request_id][step] for r in batch]).to(device)
        output = sampler(logits, build_sampling_metadata(batch, device))
        tokens = output.sampled_token_ids.cpu().tolist()
        for row, request in enumerate(batch):
            lp = output.logprobs
            entry = (tokens[row],) if lp is None else (
                tokens[row], lp.token_ids[row].cpu().tolist(), lp.logprobs[row].cpu().tolist(), int(lp.ranks[row]))
            history.setdefault(request.request_id, []).append(entry)
            request.append_output_token(tokens[row])
    return history


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_greedy_is_argmax(seed: int, device: str) -> None:
    rng = torch.Generator().manual_seed(seed)
    requests = [make_request(f"r{i}", SamplingParams(temperature=0.0), rng) for i in range(6)]
    logits = random_logits(6, rng)
    output = sampler(logits.to(device), build_sampling_metadata(requests, device))
    assert output.logprobs is None
    assert torch.equal(output.sampled_token_ids.cpu(), logits.argmax(dim=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_one_is_greedy(seed: int, device: str) -> None:
    rng = torch.Generator().manual_seed(seed)
    requests = [make_request(f"r{i}", SamplingParams(temperature=0.3 + i, top_k=1, top_p=0.9), rng)
                for i in range(6)]
    logits = random_logits(6, rng)
    output = sampler(logits.to(device), build_sampling_metadata(requests, device))
    assert torch.equal(output.sampled_token_ids.cpu(), logits.argmax(dim=1))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_row_independent_of_batch(seed: int, device: str) -> None:
    steps = 25
    rng = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.5, top_p=0.95, repetition_penalty=1.2, seed=1000 + seed)
    alone = make_request("target", params, torch.Generator().manual_seed(seed))
    batched = make_request("target", params, torch.Generator().manual_seed(seed))
    others = [make_request("seeded", SamplingParams(temperature=1.0, seed=7), rng),
              make_request("unseeded", SamplingParams(temperature=2.0), rng),
              make_request("greedy", SamplingParams(temperature=0.0), rng),
              make_request("topk", SamplingParams(temperature=1.0, top_k=10), rng)]
    # Flat logits make the draw matter: with sharp ones every sequence would be the argmax.
    logits_for = {r: [random_logits(1, rng, scale=0.5)[0] for _ in range(steps)]
                  for r in ["target", "seeded", "unseeded", "greedy", "topk"]}

    def rotating(step: int) -> list[Request]:
        batch = list(others)
        batch.insert(step % (len(others) + 1), batched)
        return batch

    expected = run_steps([alone], logits_for, steps, device)["target"]
    got = run_steps([batched], logits_for, steps, device, order_for_step=rotating)["target"]
    assert got == expected
    assert len(set(expected)) > 5, "the seeded row should actually be sampling at random"


def test_seeded_request_is_reproducible_and_seed_dependent() -> None:
    rng = torch.Generator().manual_seed(0)
    logits_for = {"r": [random_logits(1, rng, scale=0.5)[0] for _ in range(20)]}

    def tokens(seed: int) -> list[tuple]:
        request = make_request("r", SamplingParams(temperature=1.0, seed=seed), torch.Generator().manual_seed(0))
        return run_steps([request], logits_for, 20, "cpu")["r"]

    assert tokens(5) == tokens(5)
    assert tokens(5) != tokens(6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_draw_is_per_token_whatever_the_logits_columns(seed: int, device: str) -> None:
    """A head may hand the sampler logits over candidate tokens in any order, with padding (FlashHead). A
    seeded row then draws the same noise per token as over the whole vocabulary: when the candidates hold
    every token its sampled token is the same; when they hold the tokens its filters keep, too."""
    rng = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=1.0, seed=seed * 10 + 1), SamplingParams(temperature=0.6, top_p=0.9, seed=2),
              SamplingParams(temperature=1.4, min_p=0.05, seed=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=6, seed=4)]
    logits = random_logits(len(params), rng, scale=0.7)
    # Every token once, shuffled per row, plus padding columns (id -1, logit -inf).
    pad = 13
    order = torch.stack([torch.randperm(VOCAB, generator=rng) for _ in params])
    ids = torch.cat([order, torch.full((len(params), pad), -1)], dim=1)
    permuted = torch.cat([logits.gather(1, order), torch.full((len(params), pad), float("-inf"))], dim=1)

    def sample(columns: torch.Tensor, column_ids: torch.Tensor | None) -> list[int]:
        requests = [make_request(f"r{i}", p, torch.Generator().manual_seed(0)) for i, p in enumerate(params)]
        out = sampler(columns.to(device), build_sampling_metadata(requests, device),
                      column_token_ids=None if column_ids is None else column_ids.to(device), vocab_size=VOCAB)
        return out.sampled_token_ids.cpu().tolist()

    full = sample(logits, None)
    assert sample(permuted, ids) == full
    # The top-k row over a subset that holds its top 6 tokens (and 20 random others) samples the same.
    top = logits[4].topk(6).indices
    rest = torch.tensor([t for t in torch.randperm(VOCAB, generator=rng).tolist() if t not in top.tolist()][:20])
    subset_ids = torch.cat([rest[:10], top, rest[10:]]).unsqueeze(0)
    row = [SamplingParams(temperature=1.0, top_k=6, seed=4)]
    requests = [make_request("r", row[0], torch.Generator().manual_seed(0))]
    got = sampler(logits[4:5].gather(1, subset_ids).to(device), build_sampling_metadata(requests, device),
                  column_token_ids=subset_ids.to(device), vocab_size=VOCAB).sampled_token_ids.cpu().tolist()
    assert got == [full[4]]
    # Unseeded rows stay random: two calls differ somewhere over many rows.
    many = [make_request(f"u{i}", SamplingParams(temperature=1.0), rng) for i in range(50)]
    wide = random_logits(50, rng, scale=0.2).to(device)
    assert sampler(wide, build_sampling_metadata(many, device)).sampled_token_ids.tolist() != \
        sampler(wide, build_sampling_metadata(many, device)).sampled_token_ids.tolist()


def test_candidate_columns_refuse_what_needs_the_whole_vocabulary() -> None:
    rng = torch.Generator().manual_seed(0)
    ids = torch.arange(8).unsqueeze(0)
    for params in (SamplingParams(temperature=1.0, logprobs=1), SamplingParams(temperature=1.0, presence_penalty=1.0),
                   SamplingParams(temperature=1.0, min_tokens=2)):
        metadata = build_sampling_metadata([make_request("r", params, rng)], "cpu")
        with pytest.raises(ValueError, match="whole vocabulary"):
            sampler(torch.randn(1, 8), metadata, column_token_ids=ids, vocab_size=VOCAB)
    metadata = build_sampling_metadata([make_request("r", SamplingParams(temperature=1.0), rng)], "cpu")
    with pytest.raises(ValueError, match="vocab_size"):
        sampler(torch.randn(1, 8), metadata, column_token_ids=ids)


def _chi_square_p(logits: torch.Tensor, draws: torch.Tensor, temperature: float, allowed: set[int]) -> float:
    probs = torch.softmax(logits.double() / temperature, dim=0)
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[sorted(allowed)] = True
    probs = torch.where(mask, probs, 0.0)
    probs /= probs.sum()
    counts = torch.bincount(draws, minlength=logits.numel()).double()
    assert counts[~mask].sum() == 0, "sampled a token outside the allowed set"
    return chisquare(counts[mask].numpy(), (probs[mask] * draws.numel()).numpy()).pvalue


@pytest.mark.parametrize("filters", [{}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.1}])
def test_temperature_sampling_follows_softmax(filters: dict) -> None:
    vocab, draws, temperature = 8, 20_000, 0.7
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature=temperature, **filters)
    allowed = brute_force_allowed(logits, params)
    torch.manual_seed(1234)
    metadata = uniform_metadata(draws, temperature, params.top_k, params.top_p, params.min_p)
    sampled = sampler(logits.expand(draws, vocab).contiguous(), metadata).sampled_token_ids
    assert _chi_square_p(logits, sampled, temperature, allowed) > 1e-3
    # The same test rejects a sampler whose temperature were off by 30%.
    wrong = SamplingParams(temperature=temperature * 1.3, **filters)
    assert _chi_square_p(logits, sampled, wrong.temperature, brute_force_allowed(logits, wrong)) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_filters_match_brute_force_allowed_set(seed: int, device: str) -> None:
    rng = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=0.8, top_p=0.5),
              SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(temperature=2.0, top_k=40, top_p=0.7),
              SamplingParams(temperature=0.5, top_k=20, top_p=0.9, min_p=0.05), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=VOCAB + 100), SamplingParams(temperature=0.0, top_k=2)]
    requests = [make_request(f"r{i}", p, rng) for i, p in enumerate(params)]
    logits = random_logits(len(requests), rng, scale=1.5)
    metadata = build_sampling_metadata(requests, device)
    filtered = Sampler.filtered_logits(logits.to(device), metadata).cpu()
    for row, p in enumerate(params[:-1]):
        allowed = set(torch.nonzero(filtered[row].isfinite()).flatten().tolist())
        assert allowed == brute_force_allowed(logits[row], p), f"row {row}: {p}"

    # Many draws of every row in one call: none may leave its allowed set.
    repeats = 200
    requests_repeated = [r for r in requests for _ in range(repeats)]
    sampled = sampler(logits.repeat_interleave(repeats, dim=0).to(device),
                      build_sampling_metadata(requests_repeated, device)).sampled_token_ids.cpu()
    for row, p in enumerate(params[:-1]):
        draws = set(sampled[row * repeats:(row + 1) * repeats].tolist())
        assert draws <= brute_force_allowed(logits[row], p), f"row {row}: {p}"
    assert set(sampled[-repeats:].tolist()) == {int(logits[-1].argmax())}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_penalties_match_brute_force(seed: int, device: str) -> None:
    rng = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=rng).item()

    requests = []
    for i in range(6):
        params = SamplingParams(temperature=0.0 if i % 2 else 1.0, repetition_penalty=uniform(0.5, 2.0),
                                presence_penalty=uniform(-2, 2), frequency_penalty=uniform(-2, 2))
        # Small token range so histories repeat tokens and frequency counts exceed one.
        request = make_request(f"r{i}", params, rng, prompt_len=15)
        for token in torch.randint(0, 30, (20,), generator=rng).tolist():
            request.append_output_token(token)
        requests.append(request)
    requests.append(make_request("neutral", SamplingParams(temperature=1.0), rng, num_outputs=5))
    logits = random_logits(len(requests), rng)
    logits[:, :30] += 4.0  # make penalised tokens the likely ones so penalties change the argmax
    metadata = build_sampling_metadata(requests, device)
    penalized = Sampler.penalized_logits(logits.to(device), metadata).cpu().double()
    expected = torch.stack([brute_force_penalties(logits[row], r) for row, r in enumerate(requests)])
    torch.testing.assert_close(penalized, expected, rtol=1e-5, atol=1e-5)
    sampled = sampler(logits.to(device), metadata).sampled_token_ids.cpu()
    for row in range(1, len(requests) - 1, 2):
        assert sampled[row] == expected[row].argmax()


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_bans_eos_and_stop_ids(device: str) -> None:
    rng = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7, 11])
    early = make_request("early", params, rng, num_outputs=2)
    done = make_request("done", params, rng, num_outputs=3)
    ignoring = make_request("ignore", SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), rng)
    metadata = build_sampling_metadata([early, done, ignoring], device)
    assert metadata.banned_token_ids == {0: [EOS, 7, 11]}
    logits = random_logits(3, rng)
    logits[:, [EOS, 7, 11]] += 100.0
    sampled = sampler(logits.to(device), metadata).sampled_token_ids.cpu()
    masked = logits[0].clone()
    masked[[EOS, 7, 11]] = -math.inf
    assert sampled[0] == masked.argmax()
    assert sampled[1] == logits[1].argmax() and sampled[2] == logits[2].argmax()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_logit_bias_and_allowed_tokens_equal_edited_logits(seed: int, device: str) -> None:
    """A row with logit_bias / allowed_token_ids samples as the same row would from logits edited by hand (the
    biases added, every other token at -inf), for greedy and seeded random rows, beside rows with neither."""
    rng = torch.Generator().manual_seed(seed)
    ids = torch.randperm(VOCAB, generator=rng).tolist()
    bias = {t: float(b) for t, b in zip(ids[:30], (torch.rand(30, generator=rng) * 20 - 10).tolist())}
    allowed = sorted(ids[25:60])
    edits = [dict(logit_bias=bias), dict(allowed_token_ids=allowed), dict(logit_bias=bias, allowed_token_ids=allowed),
             {}]
    params = [SamplingParams(temperature=t, top_p=0.9, seed=seed * 10 + i, **edit)
              for i, (t, edit) in enumerate((t, e) for t in (0.0, 0.8) for e in edits)]
    requests = [make_request(f"r{i}", p, rng) for i, p in enumerate(params)]
    logits = random_logits(len(requests), rng)
    metadata = build_sampling_metadata(requests, device)
    got = sampler(logits.to(device), metadata).sampled_token_ids.cpu().tolist()
    assert sampler(logits.to(device), metadata).sampled_token_ids.cpu().tolist() == got   # reused device tensors
    for row, p in enumerate(params):
        edited = logits[row].clone()
        if p.allowed_token_ids is not None:
            keep = torch.zeros(VOCAB, dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            edited[~keep] = -math.inf
        for token, b in (p.logit_bias or {}).items():
            edited[token] += b
        plain = make_request("plain", dataclasses.replace(p, logit_bias=None, allowed_token_ids=None), rng)
        alone = sampler(edited[None].to(device), build_sampling_metadata([plain], device)).sampled_token_ids
        assert got[row] == int(alone[0]), (row, p)
        if p.allowed_token_ids is not None:
            assert got[row] in p.allowed_token_ids


def test_logit_edits_are_validated() -> None:
    for bad in (dict(logit_bias={-1: 1.0}), dict(logit_bias={3: 100.5}), dict(logit_bias={3: float("nan")}),
                dict(logit_bias={True: 1.0}), dict(allowed_token_ids=[]), dict(allowed_token_ids=[2, -4])):
        with pytest.raises(ValueError, match=f"^{next(iter(bad))} "):
            SamplingParams(**bad)
    params = SamplingParams(logit_bias={5: -100, 6: 100.0}, allowed_token_ids=(5, 6))
    assert params.edits_logits and params.allowed_token_ids == [5, 6]
    assert not SamplingParams(logit_bias={}).edits_logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_are_raw_log_softmax_with_ranks(seed: int, device: str) -> None:
    rng = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.5, logprobs=2),
              SamplingParams(temperature=1.0, top_k=3, repetition_penalty=1.5, logprobs=0),
              SamplingParams(temperature=1.5, top_p=0.5, seed=4), SamplingParams(temperature=1.0)]
    requests = [make_request(f"r{i}", p, rng, num_outputs=4) for i, p in enumerate(params)]
    logits = random_logits(len(requests), rng)
    output = sampler(logits.to(device), build_sampling_metadata(requests, device))
    reference = torch.log_softmax(logits.double(), dim=1)
    sampled = output.sampled_token_ids.cpu()
    lp = output.logprobs
    assert lp.token_ids.shape == (len(requests), 6) and lp.logprobs.shape == (len(requests), 6)
    assert torch.equal(lp.token_ids[:, 0].cpu(), sampled)
    top_values, top_ids = reference.sort(dim=1, descending=True)
    for row, token in enumerate(sampled.tolist()):
        assert lp.logprobs[row, 0].item() == pytest.approx(reference[row, token].item(), abs=1e-5)
        assert lp.ranks[row].item() == 1 + int((reference[row] > reference[row, token]).sum())
        assert lp.token_ids[row, 1:].cpu().tolist() == top_ids[row, :5].tolist()
        torch.testing.assert_close(lp.logprobs[row, 1:].cpu().double(), top_values[row, :5], atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_gather_logprobs_for_prompt_tokens(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    logits = random_logits(9, rng)
    next_tokens = torch.randint(0, VOCAB, (9,), generator=rng)
    reference = torch.log_softmax(logits.double(), dim=1)
    for k in (0, 4):
        result = gather_logprobs(logits, next_tokens, k)
        assert result.token_ids.shape == (9, k + 1)
        assert torch.equal(result.token_ids[:, 0], next_tokens)
        torch.testing.assert_close(result.logprobs[:, 0].double(), reference.gather(1, next_tokens[:, None])[:, 0],
                                   atol=1e-5, rtol=0)
        brute_ranks = [1 + sum(v > reference[i, t] for v in reference[i].tolist())
                       for i, t in enumerate(next_tokens.tolist())]
        assert result.ranks.tolist() == brute_ranks
        assert torch.equal(result.token_ids[:, 1:], reference.topk(k, dim=1).indices)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_mixed_batch_row_equals_row_alone(seed: int, device: str) -> None:
    steps = 8
    params = {
        "greedy": SamplingParams(temperature=0.0, logprobs=3),
        "greedy_penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
        "seeded": SamplingParams(temperature=0.8, seed=11, logprobs=1),
        "top_k": SamplingParams(temperature=1.2, top_k=5, seed=12),
        "top_p": SamplingParams(temperature=1.0, top_p=0.7, seed=13),
        "min_p": SamplingParams(temperature=1.0, min_p=0.1, seed=14),
        "penalties": SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=0.8, seed=15),
        "min_tokens": SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[5], seed=16),
        "logit_bias": SamplingParams(temperature=0.9, logit_bias={1: 2.0, 7: -1.5, 40: 3.0}, seed=17, logprobs=2),
        "allowed": SamplingParams(temperature=1.1, allowed_token_ids=[2, 9, 33, 250], top_k=3, seed=18),
        "greedy_bias": SamplingParams(temperature=0.0, logit_bias={3: 1.0, 77: 4.0}, allowed_token_ids=[3, 77, 78]),
    }
    rng = torch.Generator().manual_seed(seed)
    logits_for = {name: [random_logits(1, rng, scale=1.0)[0] for _ in range(steps)] for name in params}
    for name in logits_for:
        for step_logits in logits_for[name]:
            step_logits[[EOS, 5]] += 5.0  # the banned tokens would often win if not banned

    def fresh(name: str) -> Request:
        return make_request(name, params[name], torch.Generator().manual_seed(seed), num_outputs=2)

    batch = [fresh(name) for name in params]
    batch.append(make_request("unseeded", SamplingParams(temperature=1.0, logprobs=2), rng))
    logits_for["unseeded"] = [random_logits(1, rng)[0] for _ in range(steps)]
    together = run_steps(batch, logits_for, steps, device)
    for name in params:
        alone = run_steps([fresh(name)], logits_for, steps, device)[name]
        tokens_together = [entry[0] for entry in together[name]]
        assert tokens_together == [entry[0] for entry in alone], name
        if params[name].logprobs is not None:
            width = params[name].logprobs + 1
            for got, want in zip(together[name], alone):
                assert got[1][:width] == want[1] and got[3] == want[3], name
                assert got[2][:width] == pytest.approx(want[2], abs=1e-6), name
    assert all(token not in (EOS, 5) for token, *_ in together["min_tokens"][:2])


def test_builder_collects_params_and_flags() -> None:
    rng = torch.Generator().manual_seed(0)
    requests = [make_request("a", SamplingParams(temperature=0.0, top_k=5, top_p=0.5), rng),
                make_request("b", SamplingParams(temperature=0.7, seed=3, logprobs=4), rng, num_outputs=2),
                make_request("c", SamplingParams(temperature=1.0, min_p=0.2, presence_penalty=0.5, logprobs=1), rng,
                             num_outputs=3)]
    metadata = build_sampling_metadata(requests, "cpu")
    assert metadata.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0])
    assert metadata.top_k.dtype == torch.int64 and metadata.top_k.tolist() == [5, 0, 0]
    assert metadata.top_p.tolist() == pytest.approx([0.5, 1.0, 1.0])
    assert metadata.min_p.tolist() == pytest.approx([0.0, 0.0, 0.2])
    assert metadata.presence_penalty.tolist() == pytest.approx([0.0, 0.0, 0.5])
    assert not metadata.all_greedy and not metadata.all_random
    # The greedy row's top-k/top-p never matter, so no random row needs those stages.
    assert metadata.no_top_k and metadata.no_top_p and not metadata.no_min_p and not metadata.no_penalties
    # One step seed per seeded random row, drawn from the request's own generator (seeded with 3).
    first_draw = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)))
    assert metadata.seeds == {1: first_draw}
    assert metadata.full_vocab_rows == [1, 2]   # logprobs (b), logprobs and a penalty (c)
    assert metadata.output_token_ids == [[], [], requests[2].output_token_ids]
    assert metadata.prompt_token_ids == [[], [], []]  # no row has a repetition penalty
    assert metadata.max_num_logprobs == 4 and metadata.banned_token_ids == {}

    plain = build_sampling_metadata([make_request("d", SamplingParams(temperature=0.0), rng)], "cpu")
    assert plain.all_greedy and plain.no_penalties and plain.prompt_token_ids is None
    assert plain.max_num_logprobs is None and plain.seeds == {} and plain.full_vocab_rows == []


def test_penalties_without_histories_raise() -> None:
    metadata = uniform_metadata(2, 1.0)
    metadata.no_penalties = False
    with pytest.raises(ValueError, match="penalties"):
        sampler(torch.randn(2, 10), metadata)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_host_sync_on_cuda() -> None:
    """Building metadata and sampling must not wait on the GPU; reading the result is the one sync."""
    rng = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.9, seed=3, top_k=5),
              SamplingParams(temperature=1.1, top_p=0.8, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3),
              SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[9])]
    requests = [make_request(f"r{i}", p, rng, num_outputs=3) for i, p in enumerate(params)]
    logits = random_logits(len(requests), rng).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        output = sampler(logits, build_sampling_metadata(requests, "cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert output.sampled_token_ids.shape == (len(requests),)
    assert output.sampled_token_ids[0].item() == logits[0].argmax().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_dense_head_samples_model_dtype_logits_like_float32_ones(device, seed):
    """The dense head hands the sampler bf16 logits; greedy picks, logprobs and seeded draws equal those
    of the float32 logits that compute_logits returns (the brute-force route: float32 all the way)."""
    from pellucid.heads.dense import DenseHead
    rng = torch.Generator().manual_seed(seed)
    hidden_size = 64
    # Few distinct bf16 weights: many rows hold their maximum logit twice, so ties must break alike.
    weight = (torch.randint(-3, 4, (VOCAB, hidden_size), generator=rng) / 4).to(torch.bfloat16).to(device)
    hidden = torch.randn(6, hidden_size, generator=rng).to(torch.bfloat16).to(device)
    head = DenseHead(weight, {})
    exact = head.compute_logits(hidden)
    assert exact.dtype == torch.float32
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=3),
                   SamplingParams(temperature=0.8, top_k=20, seed=seed)):
        # Separate requests for the two routes: a seeded request's generator advances as it samples.
        requests, twins = ([make_request(f"r{i}", params, rng) for i in range(hidden.shape[0])] for _ in range(2))
        got = head.sample(hidden, build_sampling_metadata(requests, device), sampler)
        want = sampler(exact, build_sampling_metadata(twins, device))
        assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
        if params.logprobs is not None:
            assert torch.equal(got.logprobs.logprobs, want.logprobs.logprobs)
            assert torch.equal(got.logprobs.token_ids, want.logprobs.token_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_row_whose_constraints_exclude_every_token_gets_no_token(device: str, temperature: float) -> None:
    """allowed_token_ids inside the min_tokens bans leave nothing: that row gets NO_TOKEN (never a token its
    constraints exclude), its logprobs are still computed, and the other rows sample as alone."""
    rng = torch.Generator().manual_seed(3)
    stuck = SamplingParams(temperature=temperature, seed=1, min_tokens=2, allowed_token_ids=[EOS], logprobs=2)
    free = SamplingParams(temperature=temperature, seed=2, logit_bias={9: 1.0}, logprobs=2)
    requests = [make_request("stuck", stuck, rng), make_request("free", free, rng)]
    logits = random_logits(2, rng)
    output = sampler(logits.to(device), build_sampling_metadata(requests, device))
    alone = sampler(logits[1:].to(device), build_sampling_metadata([make_request("free", free, rng)], device))
    assert output.sampled_token_ids.cpu().tolist() == [NO_TOKEN, int(alone.sampled_token_ids[0])]
    assert output.logprobs.token_ids.shape == (2, 3)
