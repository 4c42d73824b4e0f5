"""FlashHead on CPU: balanced clustering, exactness with all probes, sampling distributions, asset checks,
and the rule that rows needing full-vocabulary logits go through the dense head."""
from __future__ import annotations

import re

import pytest
import torch

from pellucid.heads.flashhead import FlashHead
from pellucid.heads.flashhead.asset import AssetMismatchError, default_asset_path, save_asset
from pellucid.heads.flashhead.clustering import PAD_TOKEN, balanced_spherical_kmeans, resolve_shape
from pellucid.heads.registry import build_head
from pellucid.runner.sampler import Sampler
from pellucid.runner.sampling_metadata import SamplingMetadata

scipy_stats = pytest.importorskip("scipy.stats")

SEEDS = [0, 1, 2]


def make_metadata(rows: int, temperature: float = 0.0, top_k: int = 0, **overrides) -> SamplingMetadata:
    fields = dict(
        temperature=torch.full((rows,), temperature), top_p=torch.ones(rows),
        top_k=torch.full((rows,), top_k, dtype=torch.int64), min_p=torch.zeros(rows),
        presence_penalty=torch.zeros(rows), frequency_penalty=torch.zeros(rows),
        repetition_penalty=torch.ones(rows), all_greedy=temperature == 0, all_random=temperature > 0,
        no_top_p=True, no_top_k=top_k == 0, no_min_p=True, no_penalties=True)
    fields.update(overrides)
    return SamplingMetadata(**fields)


def make_head(tmp_path, weight: torch.Tensor, cluster_size: int, probes: int | None, seed: int = 0) -> FlashHead:
    clustering = balanced_spherical_kmeans(weight, cluster_size=cluster_size, iterations=4, seed=seed,
                                           device="cpu", progress=False)
    path = save_asset(str(tmp_path / f"asset-{seed}.safetensors"), clustering, weight)
    options = {"asset": path} if probes is None else {"asset": path, "probes": probes}
    return FlashHead(weight, options)


@pytest.mark.parametrize("seed", SEEDS)
def test_clustering_is_balanced_and_covers_every_token_once(seed):
    torch.manual_seed(seed)
    vocab, size = 500, 16
    weight = torch.randn(vocab, 64)
    result = balanced_spherical_kmeans(weight, cluster_size=size, iterations=5, seed=seed, device="cpu",
                                       progress=False)
    clusters = -(-vocab // size)
    assert result.token_ids.shape == (clusters, size)
    real = result.token_ids[result.token_ids != PAD_TOKEN]
    assert torch.equal(real.sort().values, torch.arange(vocab))
    assert int((result.token_ids == PAD_TOKEN).sum()) == clusters * size - vocab
    assert bool(((result.token_ids != PAD_TOKEN).sum(dim=1) > 0).all())
    # Centroids are the mean raw row of each cluster (brute force).
    for c in range(0, clusters, 7):
        ids = result.token_ids[c][result.token_ids[c] != PAD_TOKEN]
        torch.testing.assert_close(result.centroids[c], weight[ids].mean(dim=0), rtol=1e-5, atol=1e-5)
    # Better than a random balanced partition of the same sizes.
    rows = torch.nn.functional.normalize(weight, dim=1)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed + 100))
    random_sim = sum(float((rows[g] @ torch.nn.functional.normalize(rows[g].sum(0), dim=0)).mean())
                     for g in perm.split(size)) / clusters
    assert result.mean_similarity > random_sim + 0.05


def test_resolve_shape_takes_either_size_and_refuses_disagreeing_pairs():
    assert resolve_shape(500, None, None) == (32, 16)
    assert resolve_shape(500, None, 16) == (32, 16)
    assert resolve_shape(500, 32, None) == (32, 16)
    assert resolve_shape(500, 40, None) == (40, 13)
    assert resolve_shape(500, 1, None) == (1, 500) and resolve_shape(500, 500, None) == (500, 1)
    with pytest.raises(ValueError, match="use 32 clusters"):
        resolve_shape(500, 40, 16)
    for clusters in (0, 501):
        with pytest.raises(ValueError, match=r"clusters must be in \[1, vocab_size=500\]"):
            resolve_shape(500, clusters, None)
    with pytest.raises(ValueError, match="cluster_size must be >= 1"):
        resolve_shape(500, None, 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_any_number_of_clusters_is_balanced_and_covers_every_token_once(seed):
    """--clusters C for any C in [1, V]: C clusters, none empty, sizes as even as needed to leave none
    empty (all S when the spare slots are fewer than S, else ceil or floor of V / C), every token once."""
    rng = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(50, 400, (1,), generator=rng))
    weight = torch.randn(vocab, 24, generator=rng)
    choices = {1, vocab, int(torch.randint(2, vocab, (1,), generator=rng)), vocab // 3 + 1, vocab // 7 + 2}
    for clusters in sorted(choices):
        result = balanced_spherical_kmeans(weight, clusters=clusters, iterations=2, seed=seed, device="cpu",
                                           progress=False)
        size = -(-vocab // clusters)
        assert result.token_ids.shape == (clusters, size), clusters
        real = result.token_ids[result.token_ids != PAD_TOKEN]
        assert torch.equal(real.sort().values, torch.arange(vocab)), clusters
        counts = (result.token_ids != PAD_TOKEN).sum(dim=1)
        assert bool((counts >= 1).all()), clusters
        if clusters * size - vocab >= size:       # many spare slots: the sizes are as even as possible
            assert set(counts.tolist()) <= {vocab // clusters, vocab // clusters + 1}, clusters
        assert torch.isfinite(result.centroids).all()


@pytest.mark.parametrize("probes", ["12", 12.7, 12.0, True, None, [12]])
def test_probes_must_be_an_integer(tmp_path, probes):
    torch.manual_seed(0)
    weight = torch.randn(300, 32)
    clustering = balanced_spherical_kmeans(weight, cluster_size=16, iterations=1, device="cpu", progress=False)
    path = save_asset(str(tmp_path / "a.safetensors"), clustering, weight)
    with pytest.raises(ValueError, match=r"probes must be an integer in \[1, 19\].*got " + re.escape(repr(probes))):
        FlashHead(weight, {"asset": path, "probes": probes})
    import numpy as np
    assert FlashHead(weight, {"asset": path, "probes": np.int64(12)}).probes == 12     # any integer type


@pytest.mark.parametrize("seed", SEEDS)
def test_all_probes_greedy_equals_dense(tmp_path, seed):
    torch.manual_seed(seed)
    weight, hidden = torch.randn(500, 64), torch.randn(32, 64)
    head = make_head(tmp_path, weight, cluster_size=16, probes=32, seed=seed)
    dense = (hidden @ weight.T).argmax(dim=1)
    assert torch.equal(head.greedy(hidden), dense)
    out = head.sample(hidden, make_metadata(32), Sampler())
    assert torch.equal(out.sampled_token_ids, dense)


@pytest.mark.parametrize("seed", SEEDS)
def test_fewer_probes_is_exact_retrieval_and_agreement_is_measured(tmp_path, seed):
    torch.manual_seed(seed)
    weight, hidden = torch.randn(500, 64), torch.randn(64, 64)
    probes = 4
    head = make_head(tmp_path, weight, cluster_size=16, probes=probes, seed=seed)
    # Brute-force reference of the retrieval: top-p clusters by centroid score, argmax over their tokens.
    chosen = (hidden @ head.centroids.T).topk(probes, dim=1).indices
    logits = hidden @ weight.T
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    for r in range(hidden.shape[0]):
        ids = head.cluster_token_ids[chosen[r]].reshape(-1)
        allowed[r, ids[ids != PAD_TOKEN]] = True
    reference = logits.masked_fill(~allowed, float("-inf")).argmax(dim=1)
    got = head.greedy(hidden)
    assert torch.equal(got, reference)
    agreement = float((got == logits.argmax(dim=1)).float().mean())
    print(f"seed {seed}: top-1 agreement with {probes}/32 probes on random weights = {agreement:.3f}")
    assert 0.0 <= agreement <= 1.0


def _chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 5  # pool the rare tail so the chi-square approximation holds
    observed = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)])
    expected = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    if expected[-1] == 0:
        assert observed[-1] == 0
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()  # float rounding only
    return float(scipy_stats.chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampling_with_all_probes_matches_dense_softmax(tmp_path, seed, top_k):
    torch.manual_seed(seed)
    weight = torch.randn(40, 16) * 0.7
    head = make_head(tmp_path, weight, cluster_size=4, probes=10, seed=seed)
    draws, temperature = 20000, 0.8
    hidden = torch.randn(1, 16).expand(draws, -1)
    logits = (hidden[0] @ weight.T) / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    out = head.sample(hidden, make_metadata(draws, temperature, top_k=top_k), Sampler())
    assert _chi_square_pvalue(out.sampled_token_ids, logits.softmax(dim=0)) > 1e-3


@pytest.mark.parametrize("seed", SEEDS)
def test_sampling_draws_clusters_in_proportion_to_centroid_probabilities(tmp_path, seed):
    torch.manual_seed(seed)
    weight = torch.randn(40, 16) * 0.7
    head = make_head(tmp_path, weight, cluster_size=4, probes=1, seed=seed)
    draws, temperature = 20000, 1.3
    hidden = torch.randn(1, 16)
    out = head.sample(hidden.expand(draws, -1), make_metadata(draws, temperature), Sampler())
    # Reference: P(token) = softmax(centroid scores / T)[its cluster] * softmax(logits / T within cluster).
    cluster_probs = ((hidden[0] @ head.centroids.T) / temperature).softmax(dim=0)
    token_logits = (hidden[0] @ weight.T) / temperature
    probs = torch.zeros(40)
    for c in range(head.num_clusters):
        ids = head.cluster_token_ids[c]
        probs[ids] = cluster_probs[c] * token_logits[ids].softmax(dim=0)
    assert torch.isclose(probs.sum(), torch.tensor(1.0))
    assert _chi_square_pvalue(out.sampled_token_ids, probs) > 1e-3


def test_seeded_rows_reproduce(tmp_path):
    torch.manual_seed(0)
    weight, hidden = torch.randn(200, 32), torch.randn(8, 32)
    head = make_head(tmp_path, weight, cluster_size=8, probes=3)

    def run() -> torch.Tensor:
        seeds = {r: 1234 + r for r in range(8)}
        return head.sample(hidden, make_metadata(8, 1.0, seeds=seeds), Sampler()).sampled_token_ids

    first, second = run(), run()
    assert torch.equal(first, second)


def test_asset_for_another_head_is_refused(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(300, 32)
    clustering = balanced_spherical_kmeans(weight, cluster_size=16, iterations=2, device="cpu", progress=False)
    path = save_asset(str(tmp_path / "a.safetensors"), clustering, weight)
    other = weight.clone()
    other[7, 3] += 0.5
    with pytest.raises(AssetMismatchError, match="fingerprint") as info:
        FlashHead(other, {"asset": path})
    from pellucid.heads.flashhead.asset import head_fingerprint
    assert head_fingerprint(weight) in str(info.value) and head_fingerprint(other) in str(info.value)
    # The same weights in another dtype are the same head.
    FlashHead(weight.bfloat16().float(), {"asset": save_asset(str(tmp_path / "b.safetensors"), clustering,
                                                               weight.bfloat16())})


def test_asset_of_another_format_version_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    torch.manual_seed(0)
    weight = torch.randn(100, 16)
    clustering = balanced_spherical_kmeans(weight, cluster_size=8, iterations=1, device="cpu", progress=False)
    path = save_asset(str(tmp_path / "a.safetensors"), clustering, weight)
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
    meta["format_version"] = "999"
    save_file(load_file(path), path, metadata=meta)
    with pytest.raises(AssetMismatchError, match="'999'"):
        FlashHead(weight, {"asset": path})


@pytest.mark.parametrize("seed", SEEDS)
def test_rows_needing_full_vocabulary_use_dense_logits(tmp_path, seed):
    torch.manual_seed(seed)
    weight, hidden = torch.randn(500, 64), torch.randn(6, 64)
    head = make_head(tmp_path, weight, cluster_size=16, probes=1, seed=seed)
    sampler, dense_logits = Sampler(), hidden @ weight.T

    # Logprobs: every row is exact, and so are the returned logprobs.
    meta = make_metadata(6, max_num_logprobs=3)
    out = head.sample(hidden, meta, sampler)
    ref = sampler(dense_logits, make_metadata(6, max_num_logprobs=3))
    assert torch.equal(out.sampled_token_ids, ref.sampled_token_ids)
    torch.testing.assert_close(out.logprobs.logprobs, ref.logprobs.logprobs)
    assert torch.equal(out.logprobs.token_ids, ref.logprobs.token_ids)

    # Penalties over the whole vocabulary.
    history = [[int(t)] for t in dense_logits.argmax(dim=1)]
    kwargs = dict(no_penalties=False, repetition_penalty=torch.full((6,), 5.0),
                  prompt_token_ids=history, output_token_ids=[[] for _ in range(6)])
    out = head.sample(hidden, make_metadata(6, **kwargs), sampler)
    assert torch.equal(out.sampled_token_ids, sampler(dense_logits, make_metadata(6, **kwargs)).sampled_token_ids)

    # Banned tokens (min_tokens): that row alone goes dense; the others keep the retrieval result.
    banned = {2: [int(dense_logits[2].argmax())]}
    out = head.sample(hidden, make_metadata(6, banned_token_ids=banned), sampler)
    expected = head.greedy(hidden)
    expected[2] = dense_logits[2].clone().index_fill_(0, torch.tensor(banned[2]), float("-inf")).argmax()
    assert torch.equal(out.sampled_token_ids, expected)
    assert head.rows_dense == 6 + 6 + 1 and head.rows_fast == 5

    # A logit bias and an allowed set: those rows go dense, with their edits; the others keep the retrieval result.
    worst = [int(t) for t in dense_logits.argmin(dim=1)]
    edits = dict(logit_bias={1: {worst[1]: 100.0}}, allowed_token_ids={4: worst[4:6]})
    out = head.sample(hidden, make_metadata(6, **edits), sampler)
    expected = head.greedy(hidden)
    expected[1] = worst[1]
    expected[4] = worst[4] if dense_logits[4, worst[4]] >= dense_logits[4, worst[5]] else worst[5]
    assert torch.equal(out.sampled_token_ids, expected)
    assert head.rows_dense == 6 + 6 + 1 + 2 and head.rows_fast == 5 + 4


def test_build_head_standalone_uses_default_asset_in_model_dir(tmp_path):
    torch.manual_seed(0)
    weight = torch.randn(300, 32)
    clustering = balanced_spherical_kmeans(weight, cluster_size=16, iterations=2, device="cpu", progress=False)
    save_asset(str(tmp_path / "flashhead"), clustering, weight)
    assert default_asset_path(str(tmp_path)) == str(tmp_path / "flashhead" / "flashhead.safetensors")
    head = build_head("flashhead", weight, {"probes": 5}, str(tmp_path))
    assert isinstance(head, FlashHead)
    info = head.describe()
    assert (info["name"], info["clusters"], info["cluster_size"], info["probes"]) == ("flashhead", 19, 16, 5)
    with pytest.raises(ValueError, match="unknown flashhead option"):
        build_head("flashhead", weight, {"probe": 5}, str(tmp_path))
    with pytest.raises(ValueError, match="probes must be an integer in"):
        build_head("flashhead", weight, {"probes": 20}, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="flashhead build"):
        build_head("flashhead", weight, {}, str(tmp_path / "elsewhere"))
