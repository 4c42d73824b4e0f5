"""A seeded row's tokens are a function of its own seed, steps and distribution, whatever its batch-mates
need and whichever head path computes its logits (issue 17).

Head level: random hidden states per request and step go through each head with the real
SamplingMetadata builder, request by request alone and in random batches whose mates need exact logits
(logprobs, penalties, min_tokens), sample greedily or without a seed, join and leave between steps and
change places. Every sampling path is covered: greedy, temperature, top-k, top-p, min-p, and seeded rows
that themselves need exact logits. Heads: dense, FlashHead at the default probes (256 of 512 clusters)
and at all clusters, each also with the batch-size crossover forced on (max_fast_batch=1). With all
probes the fast path's distribution is the dense one, so a seeded row samples the very tokens of the
dense head. Engine level: the same comparison through LLM.generate on a tiny model, with a batch-mate
asking for logprobs, one with penalties, and one whose trace edits logits.
"""
from __future__ import annotations

import random

import pytest
import torch

from pellucid import SamplingParams
from pellucid.engine.request import Request
from pellucid.heads.dense import DenseHead
from pellucid.heads.flashhead import FlashHead
from pellucid.heads.flashhead.asset import save_asset
from pellucid.heads.flashhead.clustering import balanced_spherical_kmeans
from pellucid.runner.sampler import Sampler
from pellucid.runner.sampling_metadata_builder import build_sampling_metadata

VOCAB, HIDDEN, CLUSTER_SIZE = 8192, 32, 16     # 512 clusters: the default 256 probes are half of them
STEPS = 6
EOS = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                               reason="needs CUDA"))]

# The rows whose tokens must not move, each with its own seed.
TARGETS = {
    "temperature": SamplingParams(temperature=0.9, seed=101),
    "top_k": SamplingParams(temperature=1.2, top_k=40, seed=102),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8, seed=103),
    "min_p": SamplingParams(temperature=1.0, min_p=0.3, seed=104),
    "all_filters": SamplingParams(temperature=0.7, top_k=200, top_p=0.9, min_p=0.05, seed=105),
    "with_logprobs": SamplingParams(temperature=0.8, logprobs=2, seed=106),
    "with_penalties": SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, seed=107),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=3, seed=108),
    "greedy": SamplingParams(temperature=0.0, seed=109),
}
# Batch-mates: most of them need exact logits, the rest sample without a seed or greedily.
MATES = {
    "mate_logprobs": SamplingParams(temperature=0.0, logprobs=1),
    "mate_logprobs_random": SamplingParams(temperature=1.0, logprobs=0),
    "mate_penalty": SamplingParams(temperature=1.0, presence_penalty=0.5),
    "mate_repetition": SamplingParams(temperature=0.0, repetition_penalty=1.2),
    "mate_min_tokens": SamplingParams(temperature=1.0, min_tokens=4),
    "mate_unseeded": SamplingParams(temperature=1.0),
    "mate_greedy": SamplingParams(temperature=0.0),
}


@pytest.fixture(scope="module")
def head_weight() -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(17)) / HIDDEN ** 0.5


@pytest.fixture(scope="module")
def asset(tmp_path_factory, head_weight) -> str:
    clustering = balanced_spherical_kmeans(head_weight, cluster_size=CLUSTER_SIZE, iterations=2, seed=0,
                                           device="cpu", progress=False)
    return save_asset(str(tmp_path_factory.mktemp("flashhead") / "asset.safetensors"), clustering, head_weight)


HEADS = {
    "dense": None,
    "flash_default": {},
    "flash_all": {"probes": VOCAB // CLUSTER_SIZE},
    "flash_default_crossover": {"max_fast_batch": 1},
    "flash_all_crossover": {"probes": VOCAB // CLUSTER_SIZE, "max_fast_batch": 1},
}


def make_head(name: str, weight: torch.Tensor, asset: str, device: str):
    weight = weight.to(device)
    if HEADS[name] is None:
        return DenseHead(weight, {})
    return FlashHead(weight, {"asset": asset, **HEADS[name]})


def hidden_states(seed: int) -> dict[str, list[torch.Tensor]]:
    """Each request's hidden state per step. Scaled so the distributions are broad: the draw decides."""
    rng = torch.Generator().manual_seed(seed)
    return {name: [torch.randn(HIDDEN, generator=rng) * 4.0 for _ in range(STEPS)]
            for name in list(TARGETS) + list(MATES)}


def new_request(name: str) -> Request:
    params = TARGETS.get(name) or MATES[name]
    prompt = [(7 * len(name) + i) % VOCAB for i in range(5)]
    return Request(name, prompt, params, eos_token_ids={EOS})


def run(head, sampler: Sampler, hidden: dict[str, list[torch.Tensor]], batches: list[list[str]],
        device: str) -> dict[str, list[int]]:
    """Step s samples the requests of batches[s], in that order, each at its own next step."""
    requests: dict[str, Request] = {}
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        rows = [requests.setdefault(name, new_request(name)) for name in batch]
        states = torch.stack([hidden[r.request_id][r.num_output_tokens] for r in rows]).to(device)
        out = head.sample(states, build_sampling_metadata(rows, device), sampler).sampled_token_ids.tolist()
        for request, token in zip(rows, out):
            request.append_output_token(token)
            tokens.setdefault(request.request_id, []).append(token)
    return tokens


def random_layout(rng: random.Random, targets: list[str]) -> list[list[str]]:
    """STEPS batches holding every target (in a random place) and a random, changing set of mates. A mate
    that left does not come back, so each mate's own steps stay consecutive."""
    mates = rng.sample(list(MATES), rng.randint(1, len(MATES)))
    leaves_at = {m: rng.randint(1, STEPS) for m in mates}
    batches = []
    for step in range(STEPS):
        batch = targets + [m for m in mates if step < leaves_at[m]]
        rng.shuffle(batch)
        batches.append(batch)
    return batches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_rows_equal_alone_and_in_mixed_batches_for_every_head(head_weight, asset, seed, device):
    hidden = hidden_states(seed)
    sampler = Sampler()
    rng = random.Random(seed)
    alone_by_head = {}
    for head_name in HEADS:
        head = make_head(head_name, head_weight, asset, device)
        alone = {name: run(head, sampler, hidden, [[name]] * STEPS, device)[name] for name in TARGETS}
        alone_by_head[head_name] = alone
        for layout in range(3):
            targets = rng.sample(list(TARGETS), rng.randint(1, len(TARGETS)))
            mixed = run(head, sampler, hidden, random_layout(rng, targets), device)
            for name in targets:
                assert mixed[name] == alone[name], (head_name, layout, name)
        if isinstance(head, FlashHead) and head.probes < head.num_clusters:
            # The default probes really are approximate here, and the fast rows took the fast path.
            assert head.rows_fast > 0 and head.rows_dense > 0
    # Seeds matter: the sampled targets differ from one another and from greedy.
    dense = alone_by_head["dense"]
    assert len({tuple(dense[name]) for name in TARGETS}) == len(TARGETS)
    # With every cluster probed the fast path's distribution is the dense one: the same tokens.
    assert alone_by_head["flash_all"] == dense and alone_by_head["flash_all_crossover"] == dense
    # Rows that need exact logits take the dense head whatever the probes.
    for name in ("with_logprobs", "with_penalties"):
        assert alone_by_head["flash_default"][name] == dense[name], name


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_draws_do_not_depend_on_the_other_rows_or_the_head_path(head_weight, asset, seed):
    """One step, brute force: the seeded rows of a batch sample the same token as each row alone through the
    dense head, whether the batch goes to the dense head, FlashHead's fast path with all probes, or both."""
    g = torch.Generator().manual_seed(seed)
    rows = 7
    hidden = torch.randn(rows, HIDDEN, generator=g) * 4.0
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.5 + 0.2 * i, top_k=(0, 30)[i % 2],
                                                           seed=1000 * seed + i), eos_token_ids={EOS})
                for i in range(rows)]
    sampler = Sampler()
    dense = DenseHead(head_weight, {})
    flash = FlashHead(head_weight, {"asset": asset, "probes": VOCAB // CLUSTER_SIZE})

    def fresh(i: int) -> Request:
        r = requests[i]
        return Request(r.request_id, r.prompt_token_ids, r.sampling_params, eos_token_ids={EOS})

    alone = [int(dense.sample(hidden[i:i + 1], build_sampling_metadata([fresh(i)], "cpu"), sampler)
                 .sampled_token_ids[0]) for i in range(rows)]
    for head in (dense, flash):
        got = head.sample(hidden, build_sampling_metadata([fresh(i) for i in range(rows)], "cpu"), sampler)
        assert got.sampled_token_ids.tolist() == alone
    # Rows 0 and 3 ask for logprobs: FlashHead sends them dense and the rest through retrieval.
    mixed = [fresh(i) for i in range(rows)]
    for i in (0, 3):
        mixed[i] = Request(f"lp{i}", [1, 2, 3], SamplingParams(temperature=0.0, logprobs=1), eos_token_ids={EOS})
    fast_before = flash.rows_fast
    got = flash.sample(hidden, build_sampling_metadata(mixed, "cpu"), sampler).sampled_token_ids.tolist()
    assert flash.rows_fast - fast_before == rows - 2
    assert [got[i] for i in range(rows) if i not in (0, 3)] == [alone[i] for i in range(rows) if i not in (0, 3)]
    assert len(set(alone)) > 1


# ----------------------------------------------------------------------------------------------- engine

ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=256)
ENGINE_VOCAB, ENGINE_CLUSTER_SIZE = 1024, 2     # 512 clusters: the default 256 probes are half of them


@pytest.fixture(scope="module")
def engine_model_dir(tiny_model_factory) -> str:
    from pellucid.cli import main as cli_main
    model_dir = tiny_model_factory("llama", seed=31, vocab_size=ENGINE_VOCAB)
    assert cli_main(["flashhead", "build", model_dir, "--cluster-size", str(ENGINE_CLUSTER_SIZE),
                     "--iterations", "2", "--device", "cpu"]) == 0
    return model_dir


@pytest.fixture(scope="module")
def engines(engine_model_dir):
    from pellucid import LLM
    clusters = ENGINE_VOCAB // ENGINE_CLUSTER_SIZE
    return {"dense": LLM(engine_model_dir, **ENGINE),
            "flash_default": LLM(engine_model_dir, head="flashhead", **ENGINE),
            "flash_all": LLM(engine_model_dir, head="flashhead", head_options={"probes": clusters}, **ENGINE)}


def _tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_engine_seeded_requests_ignore_batch_mates(engines, seed):
    """LLM.generate: seeded requests alone, then among mates that need exact logits (logprobs, penalties)
    or sample without a seed, in random orders; then next to a traced request that edits its logits."""
    rng = random.Random(seed)
    vocab = ENGINE_VOCAB
    targets = [([rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))],
                SamplingParams(temperature=rng.choice([0.7, 1.0, 1.3]), top_k=rng.choice([0, 50]),
                               top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(10**6), max_tokens=6,
                               ignore_eos=True)) for _ in range(2)]
    mates = [SamplingParams(max_tokens=5, logprobs=1, ignore_eos=True),
             SamplingParams(temperature=1.0, presence_penalty=0.8, repetition_penalty=1.2, max_tokens=7,
                            ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    assert engines["flash_default"].engine.runner.head.probes < engines["flash_default"].engine.runner.head.num_clusters
    alone_by_engine = {}
    for name, llm in engines.items():
        alone = [_tokens(llm.generate([p], params, use_tqdm=False)[0]) for p, params in targets]
        alone_by_engine[name] = alone
        for _ in range(2):
            batch = [(p, params, i) for i, (p, params) in enumerate(targets)]
            batch += [([rng.randrange(3, vocab) for _ in range(rng.randint(2, 20))], m, None)
                      for m in rng.sample(mates, rng.randint(1, len(mates)))]
            rng.shuffle(batch)
            outputs = llm.generate([b[0] for b in batch], [b[1] for b in batch], use_tqdm=False)
            for (_, _, target), out in zip(batch, outputs):
                if target is not None:
                    assert _tokens(out) == alone[target], (name, target)
        # A batch-mate whose trace edits its logits samples from them; the seeded rows are unmoved.
        bias = torch.zeros(vocab)
        bias[rng.randrange(3, vocab)] = 50.0
        with llm.trace() as tr:
            with tr.invoke(targets[0][0], targets[0][1]):
                pass
            with tr.invoke([5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)):
                tr.logits.add(bias, positions={"start": -1})
            with tr.invoke(targets[1][0], targets[1][1]):
                pass
        assert [_tokens(tr.outputs[0]), _tokens(tr.outputs[2])] == alone, name
        assert _tokens(tr.outputs[1]) == [int(bias.argmax())] * 6
    assert alone_by_engine["dense"][0] != alone_by_engine["dense"][1]
    # All probes: the same distribution as the dense head, hence the same draws and tokens.
    assert alone_by_engine["flash_all"] == alone_by_engine["dense"]
