"""CUDA graphs for decode-only steps: captured model forwards per batch size, padded to the next one.

A graph replays fixed device addresses, so every input lives at a fixed place: the step's views into
the device staging region (token ids, positions, request map, slot mapping, query starts, sequence
lengths, block table; staging.py places them by padded size alone) and the attention backend's metadata
built once at capture. A replayed step only refreshes the region (build_step_batch's one non-blocking
copy, into the views captured at that size) and launches the graph.

Padding: a decode batch of n requests runs the graph of the smallest captured size B >= n with B - n
dummy requests of one token each, slot -1 (no cache write) and seq_len 0 (attention returns zeros for
them, never NaN).

Lengths: the attention metadata of a graph is built for a longest sequence length, and a backend whose
decode launch follows it (split-KV decode's split count) asks for several graphs per size
(`AttentionBackend.decode_graph_lengths`, ending at max_model_len); a step replays the graph of the first
length >= its longest sequence. Short contexts then launch few splits instead of the count the longest
length needs.

A step runs eagerly when it has a prefill row, more requests than the largest graph, a traced request
whose ops are not all tracing taps (or any request extras key registered with
`require_eager_for_extras_key` that the model does not serve in its graphs, below), or when the model
keeps recurrent state (its per-request state indexing is built per step). A traced step whose ops are
all taps replays a variant captured with those taps (`ensure_variant`, keyed by size and tapped
targets, captured lazily, capped).

A model whose forward reads per-step inputs besides token ids (forward-context extras a step hook
makes, such as a pipeline stage's inputs) can still replay graphs by implementing `GraphStepInputs`:
it keeps those inputs in device buffers of fixed addresses, which the graphs are captured reading and
which every replayed step refreshes (device copies, no sync).
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Hashable, Iterator, Protocol

import numpy as np
import torch

from pellucid.attention.metadata import CommonAttentionMetadata, ForwardContext, forward_context
from pellucid.engine.scheduler_output import SchedulerOutput
from pellucid.logger import get_logger
from pellucid.runner.buffers import StepBuffers

logger = get_logger(__name__)

# request.extras keys whose feature needs the eager forward (hooks, per-step host work inside the model).
_EAGER_EXTRAS_KEYS: set[str] = {"trace"}
# Graph variants captured with tracing taps (per batch size and tapped targets); more run eagerly.
MAX_TAP_VARIANTS = 16


class GraphStepInputs(Protocol):
    """What a model implements to take forward-context extras inside its decode graphs."""

    # Request extras keys whose steps may replay this model's graphs although the key asks for eager steps
    # (require_eager_for_extras_key): the model serves what the feature needs without Python in the forward.
    graph_extras_keys: frozenset[str]

    def prepare_cuda_graphs(self, max_graph_size: int, max_num_tokens: int) -> None:
        """Allocate the fixed buffers, before any capture (max_num_tokens: the largest step, eager or not)."""

    def graph_step_extras(self, size: int) -> dict[str, Any]:
        """The forward-context extras a graph of `size` rows is captured with: views of the fixed buffers."""

    def load_graph_step_extras(self, size: int, extras: dict[str, Any]) -> None:
        """Copy a replayed step's extras (its real rows, <= size) into the buffers `graph_step_extras(size)`
        returned, queued on the current stream."""


def _brief(key: Hashable, limit: int = 160) -> str:
    """A tap key for the log: whole when short, else its count and start (48 layers' taps made 5 kB lines)."""
    text = repr(key)
    if len(text) <= limit:
        return text
    return f"({len(key) if isinstance(key, tuple) else '?'} entries) {text[:limit]}..."


def require_eager_for_extras_key(key: str) -> None:
    """Steps holding a request with `key` in its extras run eagerly (a feature that hooks the forward)."""
    _EAGER_EXTRAS_KEYS.add(key)


def default_graph_sizes(max_num_reqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to and including max_num_reqs (as vLLM does)."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_reqs] + list(range(8, max_num_reqs + 1, 8))
    if max_num_reqs not in sizes:
        sizes.append(max_num_reqs)
    return sizes


def graphs_unavailable_reason(device: torch.device, enforce_eager: bool, backend: Any,
                              has_recurrent_state: bool) -> str | None:
    """Why this runner must run every step eagerly, or None when decode graphs can be used."""
    if device.type != "cuda":
        return "not on a CUDA device"
    if enforce_eager:
        return "enforce_eager=True"
    if not getattr(backend, "supports_cuda_graphs", False):
        return f"attention backend {backend.name!r} does not declare supports_cuda_graphs"
    if has_recurrent_state:
        return "the model keeps per-request recurrent state, indexed per step"
    return None


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture the work queued inside the block into `graph` (sharing `pool`) on `stream`, a side stream.

    Not `torch.cuda.graph`: on entry it empties torch's pinned host-memory cache (and the device cache).
    Tap variants are captured mid-serving, and every pinned block dropped by then, the saves of earlier
    traced requests among them, would go back to the driver: the next saves then pay for fresh pinned
    memory (32 ms per generate of 64 saves on the H100 machine, against 0.1 ms from the cache). Blocks
    that torch hands out during a capture are never recycled, so the cache needs no emptying here."""
    torch.cuda.synchronize()    # the capture stream starts after all queued work, as torch.cuda.graph does
    with torch.cuda.stream(stream):
        # thread_local: engines of one process (a pipeline's stages, each in its thread) keep stepping while
        # one of them captures mid-serving (a tracing tap variant); only this thread's calls are checked.
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


@dataclass
class _CapturedGraph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor             # [size, hidden] written by every replay
    context: ForwardContext          # keeps the backend metadata (split workspaces) alive


class DecodeCudaGraphs:
    """Captures and replays the model forward of decode-only steps for a set of batch sizes."""

    def __init__(self, model: torch.nn.Module, backend: Any, buffers: StepBuffers, block_size: int,
                 max_model_len: int, sizes: list[int]) -> None:
        limit = min(buffers.max_num_reqs, buffers.max_num_tokens)
        bad = [s for s in sizes if s < 1 or s > limit]
        if bad:
            raise ValueError(f"cuda_graph_sizes {bad} are outside 1..{limit} (max_num_seqs / token budget)")
        if buffers.staging is None:
            raise ValueError("CUDA graphs replay fixed input addresses: the step buffers must stage their copies")
        self.model = model
        self.backend = backend
        self.buffers = buffers
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = sorted(set(sizes))
        # Extras keys the model serves inside its graphs (GraphStepInputs), and its fixed input buffers.
        self.model_extras_keys = frozenset(getattr(model, "graph_extras_keys", ()))
        prepare = getattr(model, "prepare_cuda_graphs", None)
        if prepare is not None:
            prepare(self.sizes[-1], buffers.max_num_tokens)
        self._graphs: dict[tuple[int, int], _CapturedGraph] = {}     # (size, longest length) -> graph
        self._lengths: dict[int, list[int]] = {}                        # size -> its graphs' lengths, ascending
        self._pool: Any = None
        self._capture_stream: torch.cuda.Stream | None = None
        self.num_replays = 0                 # counters for tests and benchmarks
        self.replayed_sizes: set[int] = set()
        self.replayed_graphs: set[tuple[int, int]] = set()      # (size, length) of the graphs replayed
        # ---- tracing tap variants (begin; pellucid/tracing/taps.py) ----
        # (size, tap key) -> a graph captured with the step's tap hooks, captured on first use.
        self._tap_graphs: dict[tuple[int, Hashable], _CapturedGraph] = {}
        self.max_tap_variants = MAX_TAP_VARIANTS
        self._refused_tap_keys: set[Hashable] = set()
        self.num_tap_replays = 0
        # ---- tracing tap variants (end) ----

    @property
    def max_size(self) -> int:
        return self.sizes[-1] if self._graphs else 0

    def size_for(self, so: SchedulerOutput, handled_extras_keys: Collection[str] = ()) -> int | None:
        """The captured size to replay for this step, or None when it must run eagerly.
        `handled_extras_keys`: eager-only extras keys the caller serves with a graph variant (tracing taps)."""
        num_reqs = so.num_reqs
        if not self._graphs or num_reqs == 0 or num_reqs > self.sizes[-1]:
            return None
        if so.total_num_scheduled_tokens != num_reqs:
            return None      # a prefill or chunked-prefill row
        # The keys that force eager steps here, computed once (not one set per request: a traced batch of
        # 64 spent ~65 us a step on that on the H100 machine's CPU).
        eager_keys = _EAGER_EXTRAS_KEYS.difference(handled_extras_keys).difference(self.model_extras_keys)
        if eager_keys and any(req.extras and not eager_keys.isdisjoint(req.extras) for req in so.requests):
            return None
        index = int(np.searchsorted(self.sizes, num_reqs))
        return self.sizes[index]

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every size and length, largest first so the smaller graphs reuse its memory pool."""
        if self._graphs:
            raise RuntimeError("CUDA graphs were already captured for this runner")
        self._pool = torch.cuda.graph_pool_handle()
        self._capture_stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            lengths = self.backend.decode_graph_lengths(size, self.max_model_len)
            if not lengths or lengths[-1] != self.max_model_len or lengths != sorted(set(lengths)):
                raise ValueError(f"decode_graph_lengths({size}, {self.max_model_len}) gave {lengths}: it must ascend "
                                 "to max_model_len")
            self._lengths[size] = lengths
            for length in reversed(lengths):
                self._graphs[(size, length)] = self._capture_one(size, kv_caches, max_seq_len=length)
        self.buffers.invalidate_rows()
        logger.info("captured CUDA graphs for decode batch sizes %s (%d graphs)", self.sizes, len(self._graphs))

    def _capture_one(self, size: int, kv_caches: list[torch.Tensor], hooks: Callable[[int], Any] | None = None,
                     max_seq_len: int | None = None) -> _CapturedGraph:
        """One graph of `size` requests for sequences of up to max_seq_len tokens (default max_model_len)."""
        bufs = self.buffers
        bufs.input_ids.np[:size] = 0
        bufs.positions.np[:size] = 0
        bufs.token_to_req.np[:size] = np.arange(size, dtype=np.int32)
        bufs.slot_mapping.np[:size] = -1
        bufs.query_start_loc.np[:size + 1] = np.arange(size + 1, dtype=np.int32)
        bufs.seq_lens.np[:size] = 0
        bufs.num_computed_tokens.np[:size] = 0
        bufs.block_table.np[:size] = 0
        bufs.logits_indices.np[:size] = 0
        # The same packing and copy as a replayed step's (build_step_batch): the views, and so the device
        # addresses the graph bakes, are those of every later step of this size.
        inputs = bufs.staging.copy(size, size)
        common = CommonAttentionMetadata(
            num_reqs=size, num_tokens=size, max_query_len=1, max_seq_len=max_seq_len or self.max_model_len,
            block_size=self.block_size,
            query_start_loc=inputs.query_start_loc,
            seq_lens=inputs.seq_lens,
            num_computed_tokens=inputs.num_computed_tokens,
            block_table=inputs.block_table,
            slot_mapping=inputs.slot_mapping,
            query_start_loc_cpu=bufs.query_start_loc.cpu[:size + 1],
            seq_lens_cpu=bufs.seq_lens.cpu[:size],
            num_computed_tokens_cpu=bufs.num_computed_tokens.cpu[:size],
            block_table_cpu=bufs.block_table.cpu[:size],
        )
        input_ids = inputs.input_ids
        step_extras = getattr(self.model, "graph_step_extras", None)
        context = ForwardContext(attn_metadata=common, backend=self.backend,
                                 backend_metadata=self.backend.build_metadata(common), kv_caches=kv_caches,
                                 positions=inputs.positions, token_to_req=inputs.token_to_req,
                                 extras=step_extras(size) if step_extras is not None else {})
        with forward_context(context), (hooks(size) if hooks is not None else contextlib.nullcontext()):
            for _ in range(2):      # compile the Triton kernels and warm the allocator outside the capture
                self.model(input_ids)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self._pool, self._capture_stream):
                output = self.model(input_ids)
        return _CapturedGraph(graph, output, context)

    def length_for(self, size: int, max_seq_len: int | None) -> int:
        """The length of the graph of `size` that serves a longest sequence of max_seq_len tokens."""
        lengths = self._lengths[size]
        if max_seq_len is None:
            return lengths[-1]
        index = bisect.bisect_left(lengths, max_seq_len)
        if index == len(lengths):
            raise ValueError(f"a sequence of {max_seq_len} tokens is longer than max_model_len {lengths[-1]}")
        return lengths[index]

    # ---- tracing tap variants (begin) ----
    @torch.inference_mode()
    def ensure_variant(self, size: int, key: Hashable, hooks: Callable[[int], Any],
                       kv_caches: list[torch.Tensor]) -> bool:
        """Make sure a graph of `size` captured under `hooks(size)` (a context manager installing the
        tap hooks) exists for `key`; False (run eagerly) when that would exceed max_tap_variants.
        Call before the step's batch is built: capturing overwrites the step buffers."""
        if (size, key) in self._tap_graphs:
            return True
        if len(self._tap_graphs) >= self.max_tap_variants:
            if key not in self._refused_tap_keys:
                self._refused_tap_keys.add(key)
                logger.info("traced steps with taps %s run eagerly: %d tap graph variants are captured already "
                            "(the cap)", _brief(key), len(self._tap_graphs))
            return False
        self._tap_graphs[(size, key)] = self._capture_one(size, kv_caches, hooks)
        self.buffers.invalidate_rows()
        logger.info("captured a CUDA graph for decode batch size %d with tracing taps %s", size, _brief(key))
        return True
    # ---- tracing tap variants (end) ----

    def replay(self, size: int, tap_key: Hashable = (), extras: dict[str, Any] | None = None,
               max_seq_len: int | None = None) -> torch.Tensor:
        """Run the graph of `size` for the step's longest sequence, max_seq_len tokens (None: max_model_len),
        or the one captured with the taps of `tap_key` (those serve every length); its inputs must already
        be copied (build_step_batch padded to `size`); `extras`, the step's forward-context extras, go to
        the model's fixed buffers first (GraphStepInputs). Returns [size, hidden]."""
        if extras:
            load = getattr(self.model, "load_graph_step_extras", None)
            if load is None:
                raise RuntimeError(f"a graph step carries forward-context extras {sorted(extras)} that "
                                   f"{type(self.model).__name__} cannot take inside its graphs")
            load(size, extras)
        if tap_key:
            captured = self._tap_graphs[(size, tap_key)]
        else:
            key = (size, self.length_for(size, max_seq_len))
            captured = self._graphs[key]
            self.replayed_graphs.add(key)
        self.num_tap_replays += bool(tap_key)
        captured.graph.replay()
        self.num_replays += 1
        self.replayed_sizes.add(size)
        return captured.output
