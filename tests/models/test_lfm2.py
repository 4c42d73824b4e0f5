"""LFM2 (attention + gated short convolution) against transformers' Lfm2ForCausalLM.

Model-level tests drive the model step by step with hand-built attention metadata and the runner's
recurrent-state pool, so chunk boundaries, decodes and mixed batches are chosen exactly; engine-level
tests run `pellucid.LLM` end to end against transformers' `generate`.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch

from pellucid.attention.metadata import ForwardContext, forward_context
from pellucid.attention.torch_ref import TorchReferenceBackend
from pellucid.engine.request import Request
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.models.loader import load_model
from pellucid.runner.state_pool import RecurrentStatePool
from pellucid.sampling_params import SamplingParams
from tests.models.helpers import build_attention_metadata, relative_error

TOLERANCE = 1e-4
VOCAB = 512
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from pellucid.tiny_models import build_tiny_model

    return build_tiny_model("lfm2", str(tmp_path_factory.mktemp("lfm2")), seed=3)


@pytest.fixture(scope="module")
def lfm2_bias_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Conv biases on, embeddings untied, attention first: the other branches of the layer code."""
    from pellucid.tiny_models import build_tiny_model

    return build_tiny_model("lfm2", str(tmp_path_factory.mktemp("lfm2-bias")), seed=4, conv_bias=True,
                            tie_word_embeddings=False, conv_L_cache=4,
                            layer_types=["full_attention", "conv", "conv", "full_attention"])


@pytest.fixture(scope="module")
def hf_models() -> dict[str, torch.nn.Module]:
    return {}


def _hf_model(cache: dict[str, torch.nn.Module], model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir not in cache:
        cache[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return cache[model_dir]


def _hf_logits(hf_model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def _random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


class HybridStepper:
    """Runs the model step by step over a paged KV cache and the runner's recurrent-state pool.

    The KV cache and the state pool start filled with random values, so a slot that is read before it is
    written (or a state that should have been zeroed) shows up as wrong logits.
    """

    def __init__(self, model: torch.nn.Module, max_num_reqs: int = 8, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        gen = torch.Generator().manual_seed(seed)
        self.backend = TorchReferenceBackend(model.num_attention_heads, model.num_kv_heads, model.head_dim,
                                             torch.float32, torch.device("cpu"))
        shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.randn(shape, generator=gen) for _ in range(model.num_attention_layers)]
        self.pool = RecurrentStatePool(model.recurrent_state_shapes(), max_num_reqs, torch.float32,
                                       torch.device("cpu"))
        for state in self.pool.states:
            state.copy_(torch.randn(state.shape, generator=gen))
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, Request] = {}

    def step(self, chunks: list[tuple[str, list[int]]], finished: set[str] = frozenset(),
             num_padded_tokens: int | None = None) -> list[torch.Tensor]:
        """Compute the next tokens of each request; return each one's logits [chunk, vocab]."""
        so = SchedulerOutput(finished_request_ids=set(finished))
        for rid in finished:
            self.requests.pop(rid, None)
        for rid, token_ids in chunks:
            req = self.requests.setdefault(rid, Request(rid, token_ids, SamplingParams()))
            if req.num_computed_tokens > 0:
                req.all_token_ids += token_ids
            while len(req.block_ids) * BLOCK_SIZE < req.num_computed_tokens + len(token_ids):
                req.block_ids.append(self.free_blocks.pop())
            so.requests.append(req)
            so.num_computed_tokens.append(req.num_computed_tokens)
            so.num_scheduled_tokens.append(len(token_ids))
            so.samples.append(True)
        metadata, positions, token_to_req = build_attention_metadata(
            so.num_computed_tokens, so.num_scheduled_tokens, [r.block_ids for r in so.requests], BLOCK_SIZE,
            num_padded_tokens)
        input_ids = [t for _, ids in chunks for t in ids]
        input_ids += [0] * (len(positions) - len(input_ids))
        ctx = ForwardContext(attn_metadata=metadata, backend=self.backend,
                             backend_metadata=self.backend.build_metadata(metadata), kv_caches=self.kv_caches,
                             positions=positions, token_to_req=token_to_req, extras=self.pool.prepare(so))
        with torch.no_grad(), forward_context(ctx):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64))
            logits = hidden @ self.model.lm_head.weight.T
        for req, n in zip(so.requests, so.num_scheduled_tokens):
            req.num_computed_tokens += n
        starts = metadata.query_start_loc_cpu.tolist()
        return [logits[starts[r]:starts[r + 1]] for r in range(len(chunks))]


# ---- model level --------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["lfm2", "lfm2-bias"])
def test_batched_prefill_matches_hf(lfm2_dir, lfm2_bias_dir, hf_models, which: str) -> None:
    model_dir = lfm2_dir if which == "lfm2" else lfm2_bias_dir
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = _hf_model(hf_models, model_dir)
    for seed in range(3):
        prompts = _random_prompts(seed, [7, 33, 1, 2, 20 + 11 * seed])
        stepper = HybridStepper(model, seed=seed)
        batch = stepper.step([(f"r{i}", p) for i, p in enumerate(prompts)],
                             num_padded_tokens=sum(map(len, prompts)) + 5)
        for prompt, logits in zip(prompts, batch):
            assert relative_error(logits, _hf_logits(hf_model, prompt)) <= TOLERANCE


@pytest.mark.parametrize("which", ["lfm2", "lfm2-bias"])
def test_chunked_prefill_and_decode_match_one_shot(lfm2_dir, lfm2_bias_dir, hf_models, which: str) -> None:
    model_dir = lfm2_dir if which == "lfm2" else lfm2_bias_dir
    model, _ = load_model(model_dir, torch.float32, "cpu")
    hf_model = _hf_model(hf_models, model_dir)
    for seed in range(3):
        prompt = _random_prompts(100 + seed, [29])[0]
        expected = _hf_logits(hf_model, prompt)
        stepper = HybridStepper(model, seed=seed)
        # Chunks shorter than the conv history (1, 2) and longer ones, at random boundaries.
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(prompt)), 6))
        bounds = [0, 1, 2] + [c for c in cuts if c > 2] + [len(prompt)]
        chunked = torch.cat([stepper.step([("chunked", prompt[a:b])])[0] for a, b in zip(bounds, bounds[1:])])
        decoded = torch.cat([stepper.step([("decode", [token])])[0] for token in prompt])
        for logits in (chunked, decoded):
            assert relative_error(logits, expected) <= TOLERANCE


def test_mixed_batch_of_decode_chunk_and_fresh_prefill(lfm2_dir, hf_models) -> None:
    """One step holding a decode, a chunk continuing a saved state, and a prompt from zero; slots reused."""
    model, _ = load_model(lfm2_dir, torch.float32, "cpu")
    hf_model = _hf_model(hf_models, lfm2_dir)
    for seed in range(2):
        a, b, c, d = _random_prompts(200 + seed, [17, 23, 12, 9])
        stepper = HybridStepper(model, max_num_reqs=3, seed=seed)
        stepper.step([("a", a[:-1]), ("b", b[:10])])
        out = stepper.step([("a", a[-1:]), ("b", b[10:]), ("c", c)], num_padded_tokens=len(b) - 10 + len(c) + 4)
        assert relative_error(out[0], _hf_logits(hf_model, a)[-1:]) <= TOLERANCE
        assert relative_error(out[1], _hf_logits(hf_model, b)[10:]) <= TOLERANCE
        assert relative_error(out[2], _hf_logits(hf_model, c)) <= TOLERANCE
        # "a" finishes; "d" takes its slot, which holds a's state: it must start from zeros.
        out = stepper.step([("d", d), ("c", [5])], finished={"a"})
        assert relative_error(out[0], _hf_logits(hf_model, d)) <= TOLERANCE
        assert relative_error(out[1], _hf_logits(hf_model, c + [5])[-1:]) <= TOLERANCE


def test_model_paths_match_transformers(lfm2_dir) -> None:
    from transformers import AutoModelForCausalLM

    model, _ = load_model(lfm2_dir, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(lfm2_dir, dtype=torch.float32)
    assert dict(model.named_parameters()).keys() == dict(hf.named_parameters()).keys()
    ours = {name for name, _ in model.named_modules()}
    for name, _ in hf.named_modules():
        assert name in ours, name
    assert model.tie_word_embeddings


def test_state_pool_slots_and_errors() -> None:
    pool = RecurrentStatePool([(4, 2)], max_num_reqs=2, dtype=torch.float32, device=torch.device("cpu"))

    def so(reqs: list[tuple[str, int, int]], finished: set[str] = frozenset(), preempted: set[str] = frozenset()):
        return SchedulerOutput(requests=[Request(rid, [1] * 40, SamplingParams()) for rid, _, _ in reqs],
                               num_computed_tokens=[c for _, c, _ in reqs], num_scheduled_tokens=[n for *_, n in reqs],
                               samples=[True] * len(reqs), finished_request_ids=set(finished),
                               preempted_request_ids=set(preempted))

    from pellucid.models.recurrent_state import RECURRENT_SLOTS_KEY
    assert pool.prepare(so([("a", 0, 5), ("b", 0, 3)]))[RECURRENT_SLOTS_KEY].tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        pool.prepare(so([("c", 0, 5)]))
    assert pool.prepare(so([("b", 3, 1), ("c", 0, 5)], finished={"a"}))[RECURRENT_SLOTS_KEY].tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="covers positions up to 4"):
        pool.prepare(so([("b", 7, 1)]))
    pool.release(["b"])
    with pytest.raises(RuntimeError, match="first scheduled at position 16"):
        pool.prepare(so([("d", 16, 1)]))
    assert pool.prepare(so([("c", 5, 1)], preempted={"x"}))[RECURRENT_SLOTS_KEY].tolist() == [0]
    pool.release(["c"])
    assert pool.num_used_slots == 0


# ---- engine level -------------------------------------------------------------------------------

def _hf_greedy(hf_model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                    min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _generate(model_dir: str, prompts: list[list[int]], max_tokens: int = 24, **engine_kwargs):
    from pellucid import LLM

    llm = LLM(model_dir, dtype="float32", device="cpu", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.engine


GENERATE_LENGTHS = [3, 11, 26, 40, 1]


def test_greedy_generation_matches_transformers_across_engine_configs(lfm2_dir, hf_models) -> None:
    prompts = _random_prompts(7, GENERATE_LENGTHS)
    expected = _hf_greedy(_hf_model(hf_models, lfm2_dir), prompts, 24)
    ours, _ = _generate(lfm2_dir, prompts)
    assert ours == expected
    # Chunked prefill forced (budget smaller than the longer prompts), mixed with decodes.
    chunked, _ = _generate(lfm2_dir, prompts, max_num_batched_tokens=8)
    assert chunked == expected
    one_at_a_time, _ = _generate(lfm2_dir, prompts, max_num_seqs=1, max_num_batched_tokens=16)
    assert one_at_a_time == expected
    # A KV pool too small for all requests at once: preemption by recompute must restart conv state too.
    preempted, engine = _generate(lfm2_dir, prompts, num_kv_blocks=20, block_size=4, max_num_batched_tokens=16)
    assert engine.stats().num_preemptions > 0
    assert preempted == expected
    # The last finished requests reach the runner with the next schedule, even an empty one.
    assert engine.runner.state_pool.num_used_slots > 0
    engine.step()
    assert engine.runner.state_pool.num_used_slots == 0


def test_bias_variant_generation_matches_transformers(lfm2_bias_dir, hf_models) -> None:
    prompts = _random_prompts(8, [9, 30, 2])
    expected = _hf_greedy(_hf_model(hf_models, lfm2_bias_dir), prompts, 12)
    ours, _ = _generate(lfm2_bias_dir, prompts, max_tokens=12, max_num_batched_tokens=8)
    assert ours == expected


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("asked", [None, True, False])
def test_prefix_caching_is_off_for_hybrid_models(lfm2_dir, hf_models, asked: bool | None) -> None:
    """Two prompts sharing a long prefix: correct outputs, no prefix-cache hits, and the log says why."""
    handler = _Records()
    logging.getLogger("pellucid").addHandler(handler)
    try:
        kwargs = {} if asked is None else {"enable_prefix_caching": asked}
        shared = _random_prompts(11, [33])[0]
        prompts = [shared + [7, 8, 9], shared + [10, 11]]
        ours, engine = _generate(lfm2_dir, prompts, max_tokens=8, block_size=4, **kwargs)
    finally:
        logging.getLogger("pellucid").removeHandler(handler)
    assert ours == _hf_greedy(_hf_model(hf_models, lfm2_dir), prompts, 8)
    stats = engine.stats()
    assert stats.prefix_cache_hits == 0
    assert engine.scheduler.prefix_cache_hit_tokens == 0
    assert engine.config.cache.enable_prefix_caching is False
    notes = [r for r in handler.records if "prefix caching" in r.getMessage() and "Lfm2ForCausalLM" in r.getMessage()]
    expected_level = {None: logging.INFO, True: logging.WARNING, False: None}[asked]
    assert [r.levelno for r in notes] == ([] if expected_level is None else [expected_level])


def test_tracing_saves_match_hf_hidden_states_under_chunked_prefill(lfm2_dir, hf_models) -> None:
    """Every decoder layer's output (and the conv kernel's) is a traceable site equal to transformers'."""
    from pellucid import LLM

    llm = LLM(lfm2_dir, dtype="float32", device="cpu", max_num_batched_tokens=8)
    site_names = {s.name for s in llm.sites()}
    assert "model.layers.0.conv.conv.output" in site_names and "model.layers.1.self_attn.q_layernorm.output" in site_names
    prompts = _random_prompts(21, [19, 6, 27])
    num_layers = len(llm.engine.hf_config.layer_types)
    with llm.trace(prompts) as tr:
        layer_saves = [tr.model.layers[i].output.save() for i in range(num_layers)]
        conv_in = tr.model.layers[2].conv.conv.input.save()
    hf_model = _hf_model(hf_models, lfm2_dir)
    for r, prompt in enumerate(prompts):
        with torch.no_grad():
            hf_out = hf_model(torch.tensor([prompt]), output_hidden_states=True)
        for i in range(num_layers - 1):   # transformers reports the final normed output as the last entry
            assert relative_error(layer_saves[i][r], hf_out.hidden_states[i + 1][0]) <= TOLERANCE
        with torch.no_grad():
            last = hf_model.model.embedding_norm(layer_saves[-1][r])
        assert relative_error(last, hf_out.hidden_states[-1][0]) <= TOLERANCE
        # conv input = B * x from in_proj of the normed residual after layer 1
        layer2 = hf_model.model.layers[2]
        with torch.no_grad():
            b_gate, _, x = layer2.conv.in_proj(layer2.operator_norm(hf_out.hidden_states[2][0])).chunk(3, dim=-1)
        assert relative_error(conv_in[r], b_gate * x) <= TOLERANCE
