"""Prometheus metrics of one server (one registry per app) and the periodic stats log line."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pellucid.logger import get_logger

logger = get_logger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Gauges come from the engine's stats at scrape time; latencies come from the request handlers."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model_name}
        names = list(label)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**label)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(**label)

        self.running = gauge("pellucid:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("pellucid:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("pellucid:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        self.kv_used_blocks = gauge("pellucid:kv_cache_used_blocks", "KV cache blocks in use")
        self.kv_total_blocks = gauge("pellucid:kv_cache_total_blocks", "KV cache blocks in the pool")
        self.engine_steps = gauge("pellucid:engine_steps", "Engine steps run so far")
        self.engine_step_seconds = gauge("pellucid:engine_step_seconds",
                                         "Wall time the engine core spent in its steps so far (busy time)")
        self.prompt_tokens = counter("pellucid:prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("pellucid:generation_tokens", "Tokens generated")
        self.preemptions = counter("pellucid:num_preemptions", "Requests preempted")
        self.prefix_queries = counter("pellucid:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pellucid:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.ttft = Histogram("pellucid:time_to_first_token_seconds", "Time to first token", names,
                              buckets=_TTFT_BUCKETS, registry=self.registry).labels(**label)
        self.itl = Histogram("pellucid:inter_token_latency_seconds", "Time between output tokens", names,
                             buckets=_ITL_BUCKETS, registry=self.registry).labels(**label)
        self.e2e = Histogram("pellucid:e2e_request_latency_seconds", "Request latency, arrival to finish",
                             names, buckets=_TTFT_BUCKETS, registry=self.registry).labels(**label)
        self._success = Counter("pellucid:request_success", "Requests finished, by finish reason",
                                names + ["finished_reason"], registry=self.registry)
        self._failure = Counter("pellucid:request_failure", "Requests that ended with an error",
                                names, registry=self.registry).labels(**label)
        self._label = label
        self._lock = threading.Lock()
        self._seen = {"prompt": 0, "generation": 0, "preemptions": 0, "prefix_queries": 0, "prefix_hits": 0}

    def update_from_stats(self, stats: Any) -> None:
        """Refresh gauges and advance counters by what the engine did since the last update."""
        with self._lock:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            self.kv_used_blocks.set(stats.num_used_blocks)
            self.kv_total_blocks.set(stats.num_total_blocks)
            self.engine_steps.set(stats.num_steps)
            self.engine_step_seconds.set(stats.step_seconds)
            for key, value, metric in (("prompt", stats.prompt_tokens_total, self.prompt_tokens),
                                       ("generation", stats.generation_tokens_total, self.generation_tokens),
                                       ("preemptions", stats.num_preemptions, self.preemptions),
                                       ("prefix_queries", stats.prefix_cache_queries, self.prefix_queries),
                                       ("prefix_hits", stats.prefix_cache_hits, self.prefix_hits)):
                if value > self._seen[key]:
                    metric.inc(value - self._seen[key])
                    self._seen[key] = value

    # ---- LM head (begin) ----
    def set_lm_head(self, describe: dict[str, Any]) -> None:
        """`pellucid:lm_head_info{name=...,clusters=...,probes=...} 1` (the head's scalar parameters as
        labels) and `pellucid:lm_head_rows_total{path=...}`, the rows each of its paths served."""
        params = {k: str(v) for k, v in describe.items() if isinstance(v, (str, int, float)) and k != "asset"}
        info = Gauge("pellucid:lm_head_info", "The active LM head and its parameters",
                     ["model_name", *params], registry=self.registry)
        info.labels(**self._label, **params).set(1)
        self._head_rows = Counter("pellucid:lm_head_rows", "Rows the LM head served, by path (e.g. FlashHead's "
                                  "'fast' retrieval vs its exact 'dense' fallback)", ["model_name", "path"],
                                  registry=self.registry)
        self._head_seen: dict[str, int] = {}

    def update_lm_head_usage(self, usage: dict[str, int]) -> None:
        """Advance the per-path row counters to the head's running totals (`LMHead.usage()`)."""
        with self._lock:
            for key, total in usage.items():
                path = key.removeprefix("rows_")
                seen = self._head_seen.get(path, 0)
                if total > seen:
                    self._head_rows.labels(path=path, **self._label).inc(total - seen)
                    self._head_seen[path] = total
                elif path not in self._head_seen:
                    self._head_rows.labels(path=path, **self._label)   # exported at 0 from the start
                    self._head_seen[path] = total
    # ---- LM head (end) ----

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(finished_reason=finish_reason, **self._label).inc()

    def request_failed(self) -> None:
        self._failure.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """TTFT and inter-token latencies of one request, observed as its outputs reach the handler."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.monotonic()
        self._last_time: float | None = None
        self._last_tokens = 0

    def observe(self, num_tokens: int) -> None:
        """Record progress to `num_tokens` generated tokens (summed over the request's sequences)."""
        new = num_tokens - self._last_tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self._last_time is None:
            self.metrics.ttft.observe(now - self.start)
            new -= 1
            self._last_time = now
        if new > 0:
            # Several tokens in one output (a slow reader skipped ahead): spread the gap evenly.
            gap = (now - self._last_time) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self._last_time = now
        self._last_tokens = num_tokens

    def finish(self, finish_reason: str) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.request_finished(finish_reason)


async def log_stats_periodically(get_stats: Any, metrics: ServerMetrics, interval: float) -> None:
    """One log line every `interval` seconds while the engine is busy (throughput, queues, KV usage)."""
    previous = get_stats()
    previous_time = time.monotonic()
    was_idle = True
    while True:
        await asyncio.sleep(interval)
        stats = get_stats()
        now = time.monotonic()
        elapsed = max(now - previous_time, 1e-9)
        prompt_tps = (stats.prompt_tokens_total - previous.prompt_tokens_total) / elapsed
        gen_tps = (stats.generation_tokens_total - previous.generation_tokens_total) / elapsed
        metrics.update_from_stats(stats)
        idle = stats.num_running == 0 and stats.num_waiting == 0 and prompt_tps == 0 and gen_tps == 0
        if not (idle and was_idle):
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%% (%d/%d blocks), "
                        "Preemptions: %d", prompt_tps, gen_tps, stats.num_running, stats.num_waiting,
                        100 * stats.kv_cache_usage, stats.num_used_blocks, stats.num_total_blocks,
                        stats.num_preemptions)
        was_idle = idle
        previous, previous_time = stats, now
