"""The sampler: logits -> one token per row, batched over rows with different parameters.

Stages run in the order vLLM applies them, each skipped when SamplingMetadata's host flags say no row
needs it: structured-output grammars, allowed tokens, banned tokens (min_tokens), logit biases, penalties,
greedy argmax, temperature, min-p, top-k, top-p, then
the exponential race (per-token noise that a seeded row draws from its own generators, see
exponential_noise). Everything stays on the logits' device; the only host work is turning the
metadata's Python lists (penalty histories, banned ids) into tensors, copied with `non_blocking=True`.
"""
from __future__ import annotations

import array
from collections.abc import Callable

import torch

from pellucid.kernels import fused_kernels_enabled
from pellucid.runner.sampling_metadata import LogprobsTensors, SamplerOutput, SamplingMetadata


# The sampled id of a row whose constraints allow no token (never a vocabulary id).
NO_TOKEN = -1


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=1); on CUDA the multi-program kernel (pellucid.kernels.argmax), which reads a
    small batch's rows with many SMs instead of one per row."""
    if fused_kernels_enabled(logits, "argmax") and logits.dim() == 2 and logits.stride(1) == 1:
        from pellucid.kernels.argmax import argmax_rows
        return argmax_rows(logits)
    return logits.argmax(dim=1)


def tensor_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Send a host tensor over, pinned first when the target is CUDA: a copy from pageable memory would wait
    for the work already queued on the stream."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


def host_to_device(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Build a host tensor and send it over (tensor_to_device)."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts, scattered on the device from one flat copy of all ids."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    flat = array.array("q")
    for ids in rows:
        flat.extend(ids)
    if not flat:
        return counts
    # array -> tensor runs in C; a nested Python list would cost several times more for long histories.
    ids = torch.frombuffer(flat, dtype=torch.int64)
    ids = tensor_to_device(ids, device)
    lengths = host_to_device([len(r) for r in rows], torch.int64, device)
    # output_size keeps repeat_interleave from reading the total back from the device.
    row_of_id = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths, output_size=len(flat))
    counts.view(-1).scatter_add_(0, row_of_id * vocab_size + ids, torch.ones(len(flat), device=device))
    return counts


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> torch.Tensor:
    rows = [row for row, ids in banned_token_ids.items() for _ in ids]
    cols = [tok for ids in banned_token_ids.values() for tok in ids]
    if not rows:
        return logits
    index = host_to_device([rows, cols], torch.int64, logits.device)
    minus_inf = torch.full((len(rows),), float("-inf"), device=logits.device)
    return logits.index_put((index[0], index[1]), minus_inf)


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its tokens' logits."""
    vocab_size = logits.shape[1]

    def build() -> tuple[torch.Tensor, ...]:
        bias = metadata.logit_bias
        flat = [row * vocab_size + t for row, b in bias.items() for t in b]
        values = [v for b in bias.values() for v in b.values()]
        return host_to_device(flat, torch.int64, logits.device), host_to_device(values, torch.float32, logits.device)

    flat, values = _device_tensors(metadata, "logit_bias", build)
    # index_add: a (row, token) pair occurs once, so the sum is exact and the order cannot matter.
    return logits.reshape(-1).index_add(0, flat, values.to(logits.dtype)).view(logits.shape)


def apply_allowed_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """vLLM's allowed_token_ids: a row that names them samples among those tokens only; other rows keep all."""
    vocab_size = logits.shape[1]

    def build() -> tuple[torch.Tensor, ...]:
        allowed = metadata.allowed_token_ids
        flat = [row * vocab_size + t for row, ids in allowed.items() for t in ids]
        free = [row for row in range(logits.shape[0]) if row not in allowed]
        return host_to_device(flat, torch.int64, logits.device), host_to_device(free, torch.int64, logits.device)

    flat, free = _device_tensors(metadata, "allowed_token_ids", build)
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep.index_fill_(0, free, True)
    keep.view(-1).index_fill_(0, flat, True)
    return logits.masked_fill(~keep, float("-inf"))


def apply_grammar_bitmask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Structured outputs: each grammar row keeps only the tokens its bitmask allows."""
    assert metadata.grammar_bitmask is not None
    # Built each step: grammar masks change every step, so such metadata is never reused.
    rows = host_to_device(metadata.grammar_rows, torch.int64, logits.device)
    bitmask = metadata.grammar_bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(2) >> shifts) & 1).flatten(1)[:, :logits.shape[1]].bool()
    constrained = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)


def _device_tensors(metadata: SamplingMetadata, name: str,
                    build: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """The device tensors of one of the metadata's host fields, built once per metadata (a steady decode batch
    reuses its metadata step after step)."""
    tensors = metadata.device_tensors.get(name)
    if tensors is None:
        tensors = metadata.device_tensors[name] = build()
    return tensors


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (HF/vLLM: positive logits divided, negative
    multiplied), then OpenAI presence and frequency penalties over output tokens."""
    if metadata.prompt_token_ids is None or metadata.output_token_ids is None:
        raise ValueError("SamplingMetadata says penalties are needed but carries no prompt/output token ids")
    num_rows, vocab_size = logits.shape
    if len(metadata.prompt_token_ids) != num_rows or len(metadata.output_token_ids) != num_rows:
        raise ValueError(f"penalty token lists must have one entry per row ({num_rows}), got "
                         f"{len(metadata.prompt_token_ids)} prompt and {len(metadata.output_token_ids)} output")
    device = logits.device
    output_counts = _token_counts(metadata.output_token_ids, vocab_size, device)
    seen = (_token_counts(metadata.prompt_token_ids, vocab_size, device) > 0) | (output_counts > 0)
    repetition = metadata.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - metadata.frequency_penalty.unsqueeze(1) * output_counts
    return logits - metadata.presence_penalty.unsqueeze(1) * (output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top probability. In logit space
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), which needs no softmax."""
    threshold = logits.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """One ascending sort serves both filters. top_k 0 means off; top_p keeps the smallest set of most
    likely tokens whose mass reaches p (a token stays if the mass strictly above it is < p)."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=1)
    positions = torch.arange(vocab_size, device=logits.device).unsqueeze(0)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(positions < vocab_size - k, float("-inf"))
    if top_p is not None:
        mass_at_or_below = sorted_logits.softmax(dim=1).cumsum(dim=1)
        drop = mass_at_or_below <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives rounding in the cumulative sum
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


# A seeded row's draws in one step come from one generator per purpose, each seeded from the row's step
# seed (SamplingMetadata.seeds), so that what one purpose draws, or whether it draws at all (a head's path
# may skip it), never shifts another purpose's draws.
SAMPLER_STREAM = 0   # the sampler's exponential race over the vocabulary
HEAD_STREAM = 1      # an LM head's own draws (FlashHead's cluster draw)


def step_generator(seed: int, stream: int, device: torch.device) -> torch.Generator:
    """The generator of one purpose (stream) of a seeded row's step. Step seeds are < 2**62, so distinct
    streams never share a seed."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed + stream * 2**62)
    return generator


def exponential_noise(shape: torch.Size, device: torch.device, seeds: dict[int, int], stream: int,
                      column_ids: torch.Tensor | None = None, domain_size: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise [R, K]; unseeded rows draw from the global generator.

    A seeded row's noise at column k is draw k of its stream's generator, or, when `column_ids` [R, K] names
    which of `domain_size` items each column holds (a head's candidate tokens), draw column_ids[r, k]: an
    item gets the same draw whichever columns the row's logits have, so the row's result is a function of
    its seed, step and distribution only. Columns with a negative id (padding) get some draw. `out`: a
    float32 tensor of `shape` to draw into.
    """
    noise = out if out is not None else torch.empty(shape, dtype=torch.float32, device=device)
    if len(seeds) < shape[0]:
        noise.exponential_()
    size = shape[1] if column_ids is None else domain_size
    if seeds and size is None:
        raise ValueError("exponential_noise over named columns needs the size of their domain")
    for row, seed in seeds.items():
        drawn = torch.empty(size, dtype=torch.float32, device=device)
        drawn.exponential_(generator=step_generator(seed, stream, device))
        noise[row] = drawn if column_ids is None else drawn.index_select(0, column_ids[row].clamp_min(0))
    # A zero draw would turn a masked token's 0 probability into 0/0 = NaN, which argmax prefers.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _gather_from_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    token_ids = token_ids.to(torch.int64)
    token_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))
    # Rank counts ties against the token, as vLLM does: 1 + the number of other tokens at least as likely.
    ranks = (logprobs >= token_logprobs).sum(dim=1)
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=1)
    return LogprobsTensors(token_ids=torch.cat([token_ids.unsqueeze(1), top_ids], dim=1),
                           logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
                           ranks=ranks)


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob and 1-based rank of `token_ids[i]` under log_softmax(logits[i]), plus the k most likely
    tokens. Used for sampled tokens and, by the runner, for prompt logprobs (the next prompt token)."""
    if k < 0:
        raise ValueError(f"number of logprobs must be >= 0, got {k}")
    return _gather_from_logprobs(torch.log_softmax(logits.float(), dim=1), token_ids, k)


def _check_columns(logits: torch.Tensor, metadata: SamplingMetadata, column_token_ids: torch.Tensor,
                   vocab_size: int | None) -> None:
    if column_token_ids.shape != logits.shape or vocab_size is None:
        raise ValueError(f"column_token_ids must have the logits' shape {tuple(logits.shape)} and come with "
                         f"vocab_size; got {tuple(column_token_ids.shape)} and {vocab_size}")
    if metadata.max_num_logprobs is not None or not metadata.no_penalties or metadata.edits_logits:
        raise ValueError("logprobs, penalties, banned tokens, logit biases, allowed tokens and grammars need logits "
                         "over the whole vocabulary, not a head's candidate tokens")


def _to_vocab_ids(columns: torch.Tensor, column_token_ids: torch.Tensor | None) -> torch.Tensor:
    if column_token_ids is None:
        return columns
    return column_token_ids.gather(1, columns.to(torch.int64).unsqueeze(1)).squeeze(1)


class Sampler:
    """`sampler(logits [R, V], metadata) -> SamplerOutput`; no device-to-host syncs inside.

    Logits come float32 or in the model's dtype: plain greedy takes their argmax as they are (the same
    first maximum as on a float32 copy); everything else computes on a float32 copy.

    A head that computes logits for some tokens only (FlashHead's candidates) passes `column_token_ids`
    [R, K] (column k of row r is that token; -1 padding, whose logit is -inf) and `vocab_size`: the result
    is then vocabulary ids, and a seeded row draws the same noise per token as over the whole vocabulary.
    Logprobs, penalties and banned tokens need every logit, so they refuse such logits.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, column_token_ids: torch.Tensor | None = None,
                 vocab_size: int | None = None) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(f"logits must be [R, V] with R = {metadata.temperature.shape[0]} rows, "
                             f"got {tuple(logits.shape)}")
        if column_token_ids is not None:
            _check_columns(logits, metadata, column_token_ids, vocab_size)
        if metadata.all_greedy and metadata.max_num_logprobs is None and metadata.no_penalties \
                and not metadata.edits_logits:
            # Plain greedy: argmax on the logits as they are. A float32 copy of [R, V] bf16 logits would
            # cost more device memory traffic than the argmax itself, and picks the same (first) maximum.
            return SamplerOutput(sampled_token_ids=_to_vocab_ids(greedy_argmax(logits), column_token_ids))
        logits = logits.float()
        # Logprobs are vLLM's default "raw" ones: the model's distribution before any processing.
        raw_logprobs = torch.log_softmax(logits, dim=1) if metadata.max_num_logprobs is not None else None
        sampled = _to_vocab_ids(self.sample(logits, metadata, column_token_ids, vocab_size), column_token_ids)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_from_logprobs(raw_logprobs, sampled.clamp_min(0), metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata, column_token_ids: torch.Tensor | None = None,
               vocab_size: int | None = None) -> torch.Tensor:
        """The sampled column of each row; NO_TOKEN for a row whose constraints (an allowed set, a grammar,
        min_tokens bans) leave no token at all, which the scheduler ends with an error."""
        logits = self.penalized_logits(logits, metadata)
        # Only a mask can empty a row (top-k, top-p and min-p always keep its best token).
        satisfiable = logits.amax(dim=1) > float("-inf") if metadata.edits_logits else None
        greedy = None if metadata.all_random else greedy_argmax(logits)
        if metadata.all_greedy:
            sampled = greedy
        else:
            probs = self.filtered_logits(logits, metadata).softmax(dim=1)
            noise = exponential_noise(probs.shape, probs.device, metadata.seeds, SAMPLER_STREAM,
                                      column_token_ids, vocab_size)
            sampled = probs.div_(noise).argmax(dim=1)
            if greedy is not None:
                sampled = torch.where(metadata.temperature == 0, greedy, sampled)
        return sampled if satisfiable is None else torch.where(satisfiable, sampled, NO_TOKEN)

    @staticmethod
    def penalized_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Logits after structured-output grammars, allowed tokens, banned tokens, logit biases and penalties
        (vLLM's order): greedy rows take their argmax."""
        if metadata.grammar_rows:
            logits = apply_grammar_bitmask(logits, metadata)
        if metadata.allowed_token_ids:
            logits = apply_allowed_tokens(logits, metadata)
        if metadata.banned_token_ids:
            logits = apply_banned_tokens(logits, metadata.banned_token_ids)
        if metadata.logit_bias:
            logits = apply_logit_bias(logits, metadata)
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        return logits

    @staticmethod
    def filtered_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Penalized logits after temperature, min-p, top-k and top-p: random rows sample from their
        softmax. Greedy rows pass through with temperature 1 (their result is the argmax anyway)."""
        temperature = metadata.temperature
        if not metadata.all_random:
            temperature = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
        logits = logits / temperature.unsqueeze(1)
        if not metadata.no_min_p:
            logits = apply_min_p(logits, metadata.min_p)
        if not (metadata.no_top_k and metadata.no_top_p):
            logits = apply_top_k_top_p(logits, None if metadata.no_top_k else metadata.top_k,
                                       None if metadata.no_top_p else metadata.top_p)
        return logits
