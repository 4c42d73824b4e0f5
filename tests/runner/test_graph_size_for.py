"""DecodeCudaGraphs.size_for (no GPU needed: it reads only host state): which captured size a step replays,
and that a request whose extras need the eager forward keeps the step eager unless the caller handles them
or the model serves them inside its graphs (GraphStepInputs.graph_extras_keys)."""
from __future__ import annotations

import random
from types import SimpleNamespace

from pellucid.runner.cuda_graphs import DecodeCudaGraphs, require_eager_for_extras_key

require_eager_for_extras_key("needs_hooks")     # a feature key like tracing's, registered for this test


def _step(extras: list[dict | None], tokens_per_request: int = 1) -> SimpleNamespace:
    requests = [SimpleNamespace(extras=e) for e in extras]
    return SimpleNamespace(requests=requests, num_reqs=len(requests),
                           total_num_scheduled_tokens=tokens_per_request * len(requests))


def _graphs(sizes: list[int], model_keys: frozenset[str]) -> SimpleNamespace:
    return SimpleNamespace(sizes=sizes, _graphs={s: object() for s in sizes}, model_extras_keys=model_keys)


def _reference(sizes: list[int], so: SimpleNamespace, handled: tuple[str, ...], model_keys: frozenset[str]
               ) -> int | None:
    """Brute force over the rule: decode-only, fits a size, and no request holds an eager key that neither
    the caller nor the model handles."""
    if so.num_reqs == 0 or so.num_reqs > sizes[-1] or so.total_num_scheduled_tokens != so.num_reqs:
        return None
    for req in so.requests:
        for key in req.extras or {}:
            if key in ("trace", "needs_hooks") and key not in handled and key not in model_keys:
                return None
    return min(s for s in sizes if s >= so.num_reqs)


def test_size_for_matches_the_rule_on_random_steps():
    rng = random.Random(0)
    sizes = [1, 2, 4, 8, 16]
    choices = [None, {}, {"trace": 1}, {"needs_hooks": 1}, {"other": 1}, {"trace": 1, "other": 2}]
    for _ in range(400):
        n = rng.randint(0, 20)
        so = _step([rng.choice(choices) for _ in range(n)], tokens_per_request=rng.choice([1, 1, 1, 2]))
        handled = rng.choice([(), ("trace",), ("trace", "needs_hooks")])
        model_keys = rng.choice([frozenset(), frozenset({"needs_hooks"})])
        assert DecodeCudaGraphs.size_for(_graphs(sizes, model_keys), so, handled) == \
            _reference(sizes, so, handled, model_keys)


def test_length_for_picks_the_shortest_graph_that_holds_the_step():
    """A step replays the graph of the first captured length >= its longest sequence (brute force)."""
    rng = random.Random(1)
    for _ in range(200):
        longest = rng.randint(1, 5000)
        lengths = sorted(set(rng.sample(range(1, longest), min(rng.randint(0, 5), longest - 1)))) + [longest]
        graphs = SimpleNamespace(_lengths={3: lengths})
        assert DecodeCudaGraphs.length_for(graphs, 3, None) == longest
        for seq_len in [rng.randint(0, longest) for _ in range(20)] + lengths:
            assert DecodeCudaGraphs.length_for(graphs, 3, seq_len) == min(n for n in lengths if n >= seq_len)
        try:
            DecodeCudaGraphs.length_for(graphs, 3, longest + 1)
        except ValueError as e:
            assert "longer than max_model_len" in str(e)
        else:
            raise AssertionError("a sequence past max_model_len must be refused")
