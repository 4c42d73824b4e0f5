"""Hidden-state extraction jobs: samples in, safetensors files out, the engine kept full throughout.

`llm.extract_hidden_states(data, layers=[...], output_dir=..., generate=None, shard_size=1)` (and
`extract_hidden_states_async` for an AsyncLLM) stream samples through the engine: new requests are
added as others finish, so the batch stays full and a shard never waits for the whole data set.

With `generate=SamplingParams(...)` each sample runs twice: the model generates the response (an
ordinary request: CUDA graphs and prefix caching stay on), then one traced prefill over prompt +
response saves the hidden states. That is chosen over saving during generation because (a) it covers
the last response token, which generation never feeds back through the model, (b) traced steps run
eagerly with hooks, so tracing every decode step would slow the whole decode batch, while the extra
prefill is compute-dense and costs a small fraction of the decode time, and (c) the states come
from a teacher-forced forward, which is what a speculator sees in training. Generation is capped so
prompt + response stays below max_model_len (the extraction pass must fit the engine's limit).

The engine core writes the files (sink.py): the job opens the output directory there, sends each
sample's extraction request with its target, and closes the directory at the end, which waits for the
writer threads and reports what they wrote. The hidden states never pass through the job.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from tqdm.auto import tqdm

from pellucid.extraction.samples import RawSample, Sample, iter_raw_samples, tokenize_sample
from pellucid.extraction.sink import EXTRACTION_KEY, ExtractionTarget
from pellucid.extraction.spec import ExtractionSpec
from pellucid.extraction.writer import ExtractionError, model_fingerprint
from pellucid.logger import get_logger
from pellucid.outputs import RequestOutput
from pellucid.sampling_params import SamplingParams

logger = get_logger(__name__)

_EXTRACT_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


@dataclass
class ExtractionSummary:
    output_dir: str
    num_samples: int                  # written by this run
    num_tokens: int                   # tokens with hidden states written by this run
    num_already_done: int             # samples found in the manifest and skipped
    elapsed_s: float
    files: list[str] = field(default_factory=list)
    invalid: dict[str, str] = field(default_factory=dict)   # sample id -> why it was skipped (skip_invalid)

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / max(self.elapsed_s, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / max(self.elapsed_s, 1e-9)


@dataclass
class EngineWork:
    """One engine request the job wants run."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    extras: dict[str, Any] | None


@dataclass
class _InFlight:
    sample: Sample
    generating: bool
    prompt_length: int


class EngineSink:
    """The job's output directory, opened in the engine core (sink.py): the samples it already lists, and
    closing it. `call(method, *args)` runs an engine utility (EngineCoreClient.call_utility)."""

    def __init__(self, call: Callable[..., Any], output_dir: str, job_info: dict[str, Any], shard_size: int) -> None:
        if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
            raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")
        self._call = call
        self.output_dir = os.path.abspath(output_dir)
        opened = self._utility("open", job_info, shard_size)
        self.done_ids: set[str] = set(opened["done_ids"])
        self.num_existing = opened["num_existing"]
        self.files_written: list[str] = []
        self.closed = False

    def close(self) -> dict[str, Any]:
        """What the engine's writer wrote; ExtractionError (the first I/O error, final count) otherwise."""
        if self.closed:
            return {"num_samples": 0, "num_tokens": 0, "files": []}
        self.closed = True
        written = self._utility("close")
        self.files_written = list(written["files"])
        return written

    def _utility(self, name: str, *args: Any) -> Any:
        try:
            return self._call(f"{EXTRACTION_KEY}.{name}", self.output_dir, *args)
        except ExtractionError:
            raise
        except Exception as exc:    # the message of the engine's error, from another process
            raise ExtractionError(str(exc)) from None


class ExtractionJob:
    """The state of one job, independent of how the engine is driven (LLM or AsyncLLM)."""

    def __init__(self, data: Any, spec: ExtractionSpec, sink: EngineSink, tokenizer: Any, max_model_len: int,
                 vocab_size: int, generate: SamplingParams | None, skip_invalid: bool) -> None:
        if generate is not None:
            if not isinstance(generate, SamplingParams):
                raise ValueError(f"generate must be a SamplingParams or None, got {type(generate).__name__}")
            if generate.n != 1:
                raise ValueError(f"generate must have n=1 (one response per sample), got n={generate.n}")
        self.spec = spec
        self.sink = sink
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.generate = generate
        self.skip_invalid = skip_invalid
        self._samples = iter_raw_samples(data)
        self._exhausted = False
        self._ids = itertools.count()
        self._prefix = f"extract-{uuid.uuid4().hex[:8]}"
        self.in_flight: dict[str, _InFlight] = {}
        self.invalid: dict[str, str] = {}
        self.num_already_done = 0
        self.num_samples = 0            # samples the engine has taken to write (the writer's count is final)
        self.num_tokens = 0

    # ---- feeding the engine ---------------------------------------------------------------------
    def next_work(self) -> EngineWork | None:
        """The next sample's first request, or None when the data is exhausted."""
        while not self._exhausted:
            raw = next(self._samples, None)
            if raw is None:
                self._exhausted = True
                break
            if raw.sample_id in self.sink.done_ids:
                self.num_already_done += 1
                continue
            work = self._first_request(raw)
            if work is not None:
                return work
        return None

    def _first_request(self, raw: RawSample) -> EngineWork | None:
        try:
            sample = tokenize_sample(raw, self.tokenizer, generate=self.generate is not None)
            params = self._check_and_params(sample)
        except ValueError as exc:
            self._invalid(raw.sample_id, str(exc))
            return None
        generating = self.generate is not None
        work = EngineWork(f"{self._prefix}-{next(self._ids)}", sample.token_ids, params,
                          None if generating else self._extras(sample, len(sample.token_ids)))
        self.in_flight[work.request_id] = _InFlight(sample, generating, len(sample.token_ids))
        return work

    def _check_and_params(self, sample: Sample) -> SamplingParams:
        n, limit = len(sample.token_ids), self.max_model_len
        bad = [t for t in sample.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if self.generate is None:
            if n >= limit:
                raise ValueError(f"the sample has {n} tokens; extraction needs fewer than max_model_len={limit}")
            return _EXTRACT_PARAMS
        room = limit - 1 - n          # prompt + response must stay below max_model_len for the extraction pass
        if room < 1:
            raise ValueError(f"the prompt has {n} tokens, which leaves no room for a response within "
                             f"max_model_len={limit} (prompt + response must be < {limit})")
        asked = self.generate.max_tokens
        return dataclasses.replace(self.generate, max_tokens=room if asked is None else min(asked, room))

    def _extras(self, sample: Sample, prompt_length: int) -> dict[str, Any]:
        """The extraction request's features: the saves (kept on the device) and where the engine writes
        the sample. A fresh dict per request: the engine binds the request's own plan into it."""
        target = ExtractionTarget(self.sink.output_dir, sample.sample_id, prompt_length, self.spec.layers,
                                  self.spec.num_model_layers,
                                  tuple(bool(m) for m in sample.loss_mask) if sample.loss_mask is not None else None)
        return {**self.spec.extras(keep_on_device=True), EXTRACTION_KEY: target}

    def rejected(self, work: EngineWork, reason: str) -> None:
        """The engine refused a request (ValueError on add)."""
        entry = self.in_flight.pop(work.request_id)
        self._invalid(entry.sample.sample_id, reason)

    def _invalid(self, sample_id: str, reason: str) -> None:
        if not self.skip_invalid:
            raise ExtractionError(f"sample {sample_id!r}: {reason} (pass skip_invalid=True / --skip-invalid to "
                                  f"skip such samples)")
        logger.warning("skipping sample %r: %s", sample_id, reason)
        self.invalid[sample_id] = reason

    # ---- results --------------------------------------------------------------------------------
    def owns(self, request_id: str) -> bool:
        return request_id in self.in_flight

    def on_finished(self, output: RequestOutput) -> EngineWork | None:
        """A finished request: the generated sample's extraction request, or None once the engine has
        taken the sample to write. ExtractionError when the request or the write failed."""
        entry = self.in_flight.pop(output.request_id)
        sample = entry.sample
        if output.error:
            raise ExtractionError(f"sample {sample.sample_id!r}: the engine request failed: {output.error}")
        if entry.generating:
            response = list(output.outputs[0].token_ids)
            if not response:
                raise ExtractionError(f"sample {sample.sample_id!r}: generation ended with no tokens "
                                      f"({output.outputs[0].finish_reason})")
            mask = (sample.loss_mask if sample.loss_mask is not None else [0] * len(sample.token_ids)) + [1] * len(response)
            full = Sample(sample.sample_id, sample.token_ids + response, mask, sample.is_chat)
            # The extraction request's engine prompt is prompt + response; the sample keeps the real prompt length.
            work = EngineWork(f"{self._prefix}-{next(self._ids)}", full.token_ids, _EXTRACT_PARAMS,
                              self._extras(full, entry.prompt_length))
            self.in_flight[work.request_id] = _InFlight(full, False, entry.prompt_length)
            return work
        written = output.extras.get(EXTRACTION_KEY)
        if not written:
            raise ExtractionError(f"sample {sample.sample_id!r}: the engine reported no extraction for it")
        if "error" in written:
            raise SinkError(f"sample {sample.sample_id!r}: {written['error']}")
        self.num_samples += 1
        self.num_tokens += written["num_tokens"]
        return None

    @property
    def done(self) -> bool:
        return self._exhausted and not self.in_flight


class SinkError(ExtractionError):
    """The engine could not write a sample (its writer failed, or the request did)."""


def _make_job(data: Any, layers: Any, output_dir: str, generate: SamplingParams | None, shard_size: int,
              skip_invalid: bool, tokenizer: Any, info: Any, call: Callable[..., Any]) -> ExtractionJob:
    """A job for an engine described by `info` (EngineInfo), whose utilities `call` runs."""
    spec = ExtractionSpec.resolve(layers, info.num_hidden_layers, info.backbone)
    sink = EngineSink(call, output_dir, job_info(info.model_name, info.model, info.dtype, spec, info.hidden_size,
                                                 generate), shard_size)
    try:
        return ExtractionJob(data, spec, sink, tokenizer, info.max_model_len, info.vocab_size, generate,
                             skip_invalid)
    except BaseException:
        sink.close()
        raise


def job_info(model_name: str, model_dir: str, dtype: str, spec: ExtractionSpec, hidden_size: int,
             generate: SamplingParams | None) -> dict[str, Any]:
    """What an output directory holds (extraction.json and every file's header)."""
    gen = None if generate is None else {k: v for k, v in dataclasses.asdict(generate).items() if k != "stop_strings"}
    return {"model": model_name, "fingerprint": model_fingerprint(model_dir), "dtype": dtype,
            "layers": list(spec.layers), "hidden_size": hidden_size, "generate": gen}


def _finish(job: ExtractionJob, started: float, failure: BaseException | None) -> ExtractionSummary:
    """Close the engine's writer (writes buffered complete samples even when the job failed).

    A writer's I/O error stops the job where it is noticed (a sample the engine could not take) while
    other writer threads may still be committing files; closing waits for them and raises the same error
    again with the final sample count. That report replaces the first one (raised from here, inside the
    driver's `finally`), so the error is reported once, with the true count."""
    try:
        written = job.sink.close()
    except ExtractionError as exc:
        if failure is None:
            raise
        if isinstance(failure, SinkError):
            raise exc       # replaces the first report (already in flight, from the driver's `finally`)
        logger.error("after the job failed (%s), closing the writer failed too: %s", failure, exc)
        written = {"num_samples": job.num_samples, "num_tokens": job.num_tokens}
    return ExtractionSummary(job.sink.output_dir, written["num_samples"], written["num_tokens"],
                             job.num_already_done, time.monotonic() - started, list(job.sink.files_written),
                             dict(job.invalid))


class _Progress:
    def __init__(self, data: Any, enabled: bool) -> None:
        total = len(data) if hasattr(data, "__len__") and not isinstance(data, (str, dict)) else None
        self.bar = tqdm(total=total, desc="Extracting", unit="sample", disable=not enabled, dynamic_ncols=True)
        self.start = time.monotonic()

    def update(self, job: ExtractionJob) -> None:
        self.bar.n = job.num_samples + job.num_already_done + len(job.invalid)
        elapsed = max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{job.num_samples / elapsed:.1f} samples/s, {job.num_tokens / elapsed:.0f} tok/s")

    def close(self) -> None:
        self.bar.close()


# ---- drivers --------------------------------------------------------------------------------------
def extract_hidden_states(llm: Any, data: Any, layers: Any, output_dir: str, generate: SamplingParams | None = None,
                          shard_size: int = 1, progress: bool = True, skip_invalid: bool = False,
                          max_in_flight: int | None = None) -> ExtractionSummary:
    """Run an extraction job on an `LLM` (see the module doc and docs/extraction.md)."""
    info = llm.info
    job = _make_job(data, layers, output_dir, generate, shard_size, skip_invalid, llm.tokenizer, info,
                    llm.client.call_utility)
    # Twice the batch size: the scheduler always has waiting requests to fill a freed slot with.
    limit = max_in_flight or 2 * info.max_num_seqs
    started = time.monotonic()
    bar = _Progress(data, progress)
    failure: BaseException | None = None
    try:
        while True:
            while len(job.in_flight) < limit:
                work = job.next_work()
                if work is None:
                    break
                _add_sync(llm, job, work)
            if job.done:
                break
            if not job.in_flight:
                continue
            for output in llm.step():
                if not output.finished or not job.owns(output.request_id):
                    continue
                result = job.on_finished(output)
                if result is not None:
                    _add_sync(llm, job, result)
                else:
                    bar.update(job)
            if job.in_flight and not llm.has_unfinished_requests():
                raise RuntimeError(f"the engine went idle with {len(job.in_flight)} extraction requests unfinished")
    except BaseException as exc:
        failure = exc
        _abort_sync(llm, job)
        raise
    finally:
        bar.close()
        summary = _finish(job, started, failure)
    logger.info("extraction done: %d samples, %d tokens in %.1f s (%.1f samples/s, %.0f tok/s) -> %s; %d already "
                "done, %d invalid skipped", summary.num_samples, summary.num_tokens, summary.elapsed_s,
                summary.samples_per_s, summary.tokens_per_s, summary.output_dir, summary.num_already_done,
                len(summary.invalid))
    return summary


def _add_sync(llm: Any, job: ExtractionJob, work: EngineWork) -> None:
    try:
        llm.add_request(work.request_id, work.token_ids, work.params, work.extras)
    except ValueError as exc:
        job.rejected(work, str(exc))


def _abort_sync(llm: Any, job: ExtractionJob) -> None:
    """Abort the job's requests so the engine stays usable after a failed job."""
    try:
        for request_id in job.in_flight:
            llm.abort_request(request_id)
        job.in_flight.clear()
        while llm.has_unfinished_requests():    # the aborted requests' final reports
            llm.step()
    except Exception:       # the engine is gone too: the job's own error is the one to report
        logger.exception("aborting the extraction's requests failed")


async def extract_hidden_states_async(async_llm: Any, data: Any, layers: Any, output_dir: str,
                                      generate: SamplingParams | None = None, shard_size: int = 1,
                                      progress: bool = False, skip_invalid: bool = False,
                                      max_in_flight: int | None = None) -> ExtractionSummary:
    """The same job over an `AsyncLLM`, concurrently with whatever else it serves."""
    from pellucid.engine.async_llm import RequestFailedError

    job = await asyncio.to_thread(_make_job, data, layers, output_dir, generate, shard_size, skip_invalid,
                                  async_llm.tokenizer, async_llm.info, async_llm.call_utility_blocking)
    limit = max_in_flight or 2 * async_llm.info.max_num_seqs
    started = time.monotonic()
    bar = _Progress(data, progress)

    async def run(work: EngineWork) -> None:
        while work is not None:
            final = None
            try:
                async for output in async_llm.generate(work.token_ids, work.params, request_id=work.request_id,
                                                       extras=work.extras):
                    final = output
            except ValueError as exc:
                job.rejected(work, str(exc))
                return
            except RequestFailedError as exc:
                final = RequestOutput(work.request_id, None, work.token_ids, [], finished=True, error=exc.message)
            assert final is not None
            result = job.on_finished(final)
            if result is not None:
                work = result
                continue
            bar.update(job)
            return

    async def worker() -> None:
        while (work := job.next_work()) is not None:
            await run(work)

    failure: BaseException | None = None
    tasks = [asyncio.ensure_future(worker()) for _ in range(limit)]
    try:
        await asyncio.gather(*tasks)
    except BaseException as exc:
        failure = exc
        for task in tasks:
            task.cancel()         # cancelling a stream aborts its request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        bar.close()
        summary = await asyncio.to_thread(_finish, job, started, failure)
    return summary
