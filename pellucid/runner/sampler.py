"""The sampler: logits -> one token per row, batched over rows with different parameters.

Stages run in the order vLLM applies them, each skipped when SamplingMetadata's host flags say no row
needs it: banned tokens (min_tokens), penalties, greedy argmax, temperature, min-p, top-k, top-p, then
the exponential race. Everything stays on the logits' device; the only host work is turning the
metadata's Python lists (penalty histories, banned ids) into tensors, copied with `non_blocking=True`.
"""
from __future__ import annotations

import array

import torch

from pellucid.kernels import fused_kernels_enabled
from pellucid.runner.sampling_metadata import LogprobsTensors, SamplerOutput, SamplingMetadata


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=1); on CUDA the multi-program kernel (pellucid.kernels.argmax), which reads a
    small batch's rows with many SMs instead of one per row."""
    if fused_kernels_enabled(logits, "argmax") and logits.dim() == 2 and logits.stride(1) == 1:
        from pellucid.kernels.argmax import argmax_rows
        return argmax_rows(logits)
    return logits.argmax(dim=1)


def host_to_device(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Build a host tensor (pinned when the target is CUDA, so the copy does not block) and send it over."""
    pin = device.type == "cuda"
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True) if pin \
        else torch.tensor(values, dtype=dtype, device=device)


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
    ids = ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids
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


def exponential_noise(shape: torch.Size, device: torch.device,
                      generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exp(1) noise; seeded rows draw from their own generator so their draw never depends on the batch."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if len(generators) < shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        if generator.device.type != device.type:
            raise ValueError(f"row {row}'s generator lives on {generator.device} but the logits on {device}; "
                             "build_sampling_metadata makes device generators")
        noise[row].exponential_(generator=generator)
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


class Sampler:
    """`sampler(logits [R, V], metadata) -> SamplerOutput`; no device-to-host syncs inside.

    Logits come float32 or in the model's dtype: plain greedy takes their argmax as they are (the same
    first maximum as on a float32 copy); everything else computes on a float32 copy.
    """

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(f"logits must be [R, V] with R = {metadata.temperature.shape[0]} rows, "
                             f"got {tuple(logits.shape)}")
        if metadata.all_greedy and metadata.max_num_logprobs is None and metadata.no_penalties \
                and not metadata.banned_token_ids:
            # Plain greedy: argmax on the logits as they are. A float32 copy of [R, V] bf16 logits would
            # cost more device memory traffic than the argmax itself, and picks the same (first) maximum.
            return SamplerOutput(sampled_token_ids=greedy_argmax(logits))
        logits = logits.float()
        # Logprobs are vLLM's default "raw" ones: the model's distribution before any processing.
        raw_logprobs = torch.log_softmax(logits, dim=1) if metadata.max_num_logprobs is not None else None
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_from_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        logits = self.penalized_logits(logits, metadata)
        greedy = None if metadata.all_random else greedy_argmax(logits)
        if metadata.all_greedy:
            return greedy
        probs = self.filtered_logits(logits, metadata).softmax(dim=1)
        noise = exponential_noise(probs.shape, probs.device, metadata.generators)
        sampled = probs.div_(noise).argmax(dim=1)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature == 0, greedy, sampled)

    @staticmethod
    def penalized_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Logits after banned tokens and penalties: greedy rows take their argmax."""
        if metadata.banned_token_ids:
            logits = apply_banned_tokens(logits, metadata.banned_token_ids)
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
