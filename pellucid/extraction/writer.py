"""Extraction output: safetensors files written atomically, and a manifest of completed samples.

Directory layout:
    extraction.json          what the directory holds: model, fingerprint, dtype, layers, generate settings
    manifest.jsonl           one line per completed sample: {"id", "file", "prefix", "num_tokens", "prompt_length"}
    sample-00000001.safetensors   (shard_size 1)   or   shard-00000001.safetensors   (shard_size K)

Each sample is `hidden_states` [num_tokens, num_layers, hidden] (model dtype), `input_ids` [num_tokens]
int64, `prompt_length` (0-dim int64) and, when known, `loss_mask` [num_tokens] bool. In a one-sample
file the tensors carry those names; in a shard, sample j's are named "{j}/hidden_states", ... (the
manifest's `prefix`). The safetensors header metadata holds the layer ids, model name, fingerprint,
dtype and the sample ids of the file.

Crash safety: a file is written under a hidden temporary name in the same directory, flushed, fsynced
and renamed into place (readers never see a partial file); only then are its manifest lines appended
and fsynced. Several writer threads write files at once (one fsync waiting on the disk does not hold
up the next file); the manifest lines of files renamed meanwhile are committed together (one
directory fsync and one manifest fsync for the group), so manifest order is completion order. A restarted job trusts the manifest alone: it drops a torn last line, deletes data files
the manifest does not reference (written by a job killed before its manifest lines) and temporary
files, and skips the samples listed. One job at a time may write a directory (an advisory lock).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import queue
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from pellucid.extraction.staging import StagedStates
from pellucid.logger import get_logger

logger = get_logger(__name__)

FORMAT = "pellucid-hidden-states/1"
MANIFEST = "manifest.jsonl"
JOB_INFO = "extraction.json"
LOCK = ".extraction.lock"
_DATA_FILE = re.compile(r"^(sample|shard)-(\d{8})\.safetensors$")
_TMP_SUFFIX = ".tmp"
# Settings that must match for a directory to be resumed (mixing them would silently corrupt a dataset).
_RESUME_KEYS = ("format", "fingerprint", "dtype", "layers", "generate")


class ExtractionError(RuntimeError):
    """An extraction job stopped; completed samples are in the manifest and the job can be rerun to resume."""


@dataclass
class SampleRecord:
    sample_id: str
    input_ids: torch.Tensor              # [T] int64
    # [T, num_layers, hidden] in the model dtype, or its per-layer [T, hidden] columns (stacked in
    # tensors(), on a writer thread), or either of them still being copied from the GPU (staging.py).
    hidden_states: torch.Tensor | list[torch.Tensor] | StagedStates
    prompt_length: int
    loss_mask: torch.Tensor | None = None    # [T] bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def stacked_hidden_states(self) -> torch.Tensor:
        states = self.hidden_states
        if isinstance(states, StagedStates):
            states.wait()
            states = states.hidden_states
        if isinstance(states, list):
            return torch.stack(states, dim=1)
        return states.contiguous()

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        out = {f"{prefix}hidden_states": self.stacked_hidden_states(),
               f"{prefix}input_ids": self.input_ids.to(torch.int64).contiguous(),
               f"{prefix}prompt_length": torch.tensor(self.prompt_length, dtype=torch.int64)}
        if self.loss_mask is not None:
            out[f"{prefix}loss_mask"] = self.loss_mask.to(torch.bool).contiguous()
        return out


def model_fingerprint(model_dir: str) -> str:
    """sha256 over config.json's bytes and the names and sizes of the weight files: changes when the
    model does, without hashing gigabytes of weights."""
    digest = hashlib.sha256()
    try:
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            digest.update(f.read())
        names = sorted(n for n in os.listdir(model_dir) if n.endswith((".safetensors", ".bin", ".pt")))
    except OSError as exc:
        raise ValueError(f"cannot fingerprint the model directory {model_dir!r}: {exc}") from exc
    for name in names:
        digest.update(f"\0{name}\0{os.path.getsize(os.path.join(model_dir, name))}".encode())
    return digest.hexdigest()


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
                       torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8"}


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Any]:
    """A safetensors file as buffers to write in order: the header, then each tensor's own memory
    (no serialized copy of the data, unlike safetensors.torch.save, which matters at tens of MB per
    sample). Format: u64 little-endian header length, JSON header padded to 8 bytes, raw data."""
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[Any] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, which this writer does not support")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        parts.append(memoryview(data))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return [len(encoded).to_bytes(8, "little") + encoded, *parts]


def atomic_write(path: str, data: bytes | list[Any], sync_directory: bool = True) -> None:
    """Write `data` (bytes, or buffers written in order) to `path` so that `path` is either absent/old or
    complete: temporary name in the same directory, write, fsync, rename, fsync the directory (unless
    the caller does that itself for several files at once). Removes the temporary on failure."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}{_TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            for part in ([data] if isinstance(data, (bytes, bytearray)) else data):
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if sync_directory:
        _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(output_dir: str) -> list[dict[str, Any]]:
    """The complete lines of the manifest (a torn last line, being written or left by a crash, is ignored)."""
    path = os.path.join(output_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return []
    entries = []
    for line in raw.split(b"\n")[:-1]:       # the part after the last newline is incomplete
        if line.strip():
            entries.append(json.loads(line))
    return entries


class DatasetWriter:
    """Writes SampleRecords to `output_dir`, `shard_size` per file, on `num_threads` background threads.

    `add` buffers records into shards and hands full shards to the writer threads; `close` writes the
    last partial shard and waits. An I/O failure on a thread is raised (as ExtractionError) by the
    next `add` or by `close`; nothing written before it is affected, and no file is started after it.
    """

    def __init__(self, output_dir: str, job_info: dict[str, Any], shard_size: int = 1,
                 background: bool = True, num_threads: int = 4) -> None:
        if not isinstance(shard_size, int) or isinstance(shard_size, bool) or shard_size < 1:
            raise ValueError(f"shard_size must be an integer >= 1, got {shard_size!r}")
        if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
            raise ValueError(f"num_threads must be an integer >= 1, got {num_threads!r}")
        self.output_dir = os.path.abspath(output_dir)
        # JSON round trip: the settings compared on resume must look exactly as they do when read back.
        self.job_info = json.loads(json.dumps({"format": FORMAT, **job_info}))
        self.shard_size = shard_size
        self._lock_fd: int | None = None
        self._prepare_directory()
        entries = self._recover()
        self.done_ids: set[str] = {e["id"] for e in entries}
        self.num_existing_samples = len(self.done_ids)
        self._next_file = 1 + max((int(m.group(2)) for e in entries if (m := _DATA_FILE.match(e["file"]))), default=0)
        self._buffer: list[tuple[SampleRecord, Future[str]]] = []
        self._error: BaseException | None = None
        self._mutex = threading.Lock()     # add/flush may be called from several threads (server)
        # Group commit: manifest lines of renamed files wait in _renamed; one thread at a time commits them.
        # (file name, manifest lines, futures of its records, tokens): renamed, not yet in the manifest.
        self._renamed: list[tuple[str, list[str], list[Future[str]], int]] = []
        self._renamed_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self._manifest_broken = False      # a failed append could not be cut off: commit nothing more
        self.files_written: list[str] = []
        self.num_samples_written = 0
        self.num_tokens_written = 0
        self._queue: queue.Queue[tuple[str, list[tuple[SampleRecord, Future[str]]]] | None] | None = None
        self._threads: list[threading.Thread] = []
        if background:
            # Bounds the memory of shards waiting for the disk (their pinned host buffers).
            self._queue = queue.Queue(maxsize=2 * num_threads)
            self._threads = [threading.Thread(target=self._drain, name=f"pellucid-extraction-writer-{i}", daemon=True)
                             for i in range(num_threads)]
            for thread in self._threads:
                thread.start()

    # ---- opening --------------------------------------------------------------------------------
    def _prepare_directory(self) -> None:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            probe = os.path.join(self.output_dir, f".write-probe.{os.getpid()}{_TMP_SUFFIX}")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as exc:
            raise ExtractionError(f"the output directory {self.output_dir!r} is not writable: {exc}") from exc
        self._lock_fd = os.open(os.path.join(self.output_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise ExtractionError(f"another extraction job is writing to {self.output_dir!r}") from exc

    def _recover(self) -> list[dict[str, Any]]:
        """Check the directory's settings, repair the manifest, remove what a killed job left half done."""
        info_path = os.path.join(self.output_dir, JOB_INFO)
        if os.path.exists(info_path):
            with open(info_path, encoding="utf-8") as f:
                existing = json.load(f)
            for key in _RESUME_KEYS:
                if existing.get(key) != self.job_info.get(key):
                    self._release_lock()
                    raise ExtractionError(
                        f"{self.output_dir!r} holds an extraction with {key}={existing.get(key)!r}, but this job has "
                        f"{key}={self.job_info.get(key)!r}; use another output directory")
        else:
            atomic_write(info_path, (json.dumps(self.job_info, indent=2, sort_keys=True) + "\n").encode())
        entries = read_manifest(self.output_dir)
        self._truncate_torn_manifest_line()
        referenced = {e["file"] for e in entries}
        for name in os.listdir(self.output_dir):
            stale = name.endswith(_TMP_SUFFIX) or (_DATA_FILE.match(name) is not None and name not in referenced)
            if stale:
                logger.info("removing %s, left by an interrupted job (its samples are not in the manifest and "
                            "will be extracted again)", name)
                os.unlink(os.path.join(self.output_dir, name))
        return entries

    def _truncate_torn_manifest_line(self) -> None:
        path = os.path.join(self.output_dir, MANIFEST)
        if not os.path.exists(path):
            return
        with open(path, "rb+") as f:
            raw = f.read()
            keep = raw.rfind(b"\n") + 1
            if keep != len(raw):
                logger.warning("dropping a torn last line of %s (written by an interrupted job)", path)
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())

    # ---- writing --------------------------------------------------------------------------------
    def add(self, record: SampleRecord) -> "Future[str]":
        """Queue a record; the future gives its file's name once the manifest lists it (or the error that
        kept it from being written). ExtractionError at once if a writer thread has already failed."""
        done: Future[str] = Future()
        with self._mutex:
            self._raise_pending()
            self._buffer.append((record, done))
            if len(self._buffer) >= self.shard_size:
                self._submit(self._buffer)
                self._buffer = []
        return done

    def write_now(self, record: SampleRecord) -> str:
        """Write one record as its own file synchronously (server use); returns the file name."""
        if self._threads:
            raise RuntimeError("write_now is for writers made with background=False")
        with self._mutex:
            self._raise_pending()
            name = self._take_name()
            self._write_shard(name, [(record, Future())])
            return name

    def flush(self) -> None:
        """Hand the partial shard (if any) to the writers."""
        with self._mutex:
            if self._buffer:
                self._submit(self._buffer)
                self._buffer = []

    @property
    def error(self) -> BaseException | None:
        """The first I/O error of a writer thread (what `add` and `close` raise as ExtractionError), or None."""
        return self._error

    def close(self) -> None:
        """Write what is buffered, wait for the writer threads, release the directory. Raises the first
        I/O error if there was one; its sample count is final then (no thread commits any more)."""
        try:
            if self._error is None:
                self.flush()
            if self._threads:
                assert self._queue is not None
                for _ in self._threads:
                    self._queue.put(None)
                for thread in self._threads:
                    thread.join()
                self._threads = []
            _fail([done for _, done in self._buffer], ExtractionError("the writer closed after a failure; "
                                                                       "this sample was not written"))
            self._buffer = []
            self._raise_pending()
        finally:
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _take_name(self) -> str:
        """The next data file's name (called under _mutex, so names follow submission order)."""
        kind = "sample" if self.shard_size == 1 else "shard"
        name = f"{kind}-{self._next_file:08d}.safetensors"
        self._next_file += 1
        return name

    def _submit(self, items: list[tuple[SampleRecord, "Future[str]"]]) -> None:
        name = self._take_name()
        if self._queue is None:
            self._write_shard(name, items)
            return
        while True:     # wake up now and then to notice a writer that failed while we wait for room
            try:
                self._queue.put((name, items), timeout=0.5)
                return
            except queue.Full:
                try:
                    self._raise_pending()
                except ExtractionError as exc:
                    _fail([done for _, done in items], exc)
                    raise

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            name, items = item
            if self._error is not None:
                # After a failure, start no more files (the job is stopping).
                _fail([done for _, done in items], ExtractionError("not written: an earlier write failed"))
                continue
            try:
                self._write_shard(name, items)
            except BaseException as exc:
                if self._error is None:
                    self._error = exc
                _fail([done for _, done in items], exc)

    def _raise_pending(self) -> None:
        if self._error is not None:
            exc = self._error
            hint = " (the disk is full)" if isinstance(exc, OSError) and exc.errno == errno.ENOSPC else ""
            raise ExtractionError(
                f"writing to {self.output_dir!r} failed{hint}: {exc}. The {self.num_existing_samples + self.num_samples_written} "
                f"samples listed in {MANIFEST} are complete; fix the problem and rerun the same job to resume") from exc

    def _write_shard(self, name: str, items: list[tuple[SampleRecord, "Future[str]"]]) -> None:
        records = [record for record, _ in items]
        single = self.shard_size == 1
        tensors: dict[str, torch.Tensor] = {}
        lines = []
        for j, record in enumerate(records):
            prefix = "" if single else f"{j}/"
            tensors.update(record.tensors(prefix))
            lines.append(json.dumps({"id": record.sample_id, "file": name, "prefix": prefix,
                                     "num_tokens": record.num_tokens, "prompt_length": record.prompt_length}))
        metadata = {key: value if isinstance(value, str) else json.dumps(value) for key, value in self.job_info.items()}
        metadata["sample_ids"] = json.dumps([r.sample_id for r in records])
        metadata["num_samples"] = str(len(records))
        atomic_write(os.path.join(self.output_dir, name), safetensors_parts(tensors, metadata), sync_directory=False)
        with self._renamed_lock:
            self._renamed.append((name, lines, [done for _, done in items], sum(r.num_tokens for r in records)))
        self._commit_renamed()

    def _commit_renamed(self) -> None:
        """Make the renames durable (one directory fsync) and list the files in the manifest, for every
        file renamed so far: a thread that finds its lines already committed by another is done."""
        with self._commit_lock:
            with self._renamed_lock:
                batch, self._renamed = self._renamed, []
            if not batch:
                return
            try:
                if self._manifest_broken:
                    # Its end may hold a partial line, which the next line would turn into garbage.
                    raise OSError(f"{MANIFEST} could not be cut back to whole lines after a failed append; no "
                                  f"more samples are listed until the job is rerun (which repairs it)")
                _fsync_dir(self.output_dir)
                self._append_to_manifest(("\n".join(line for _, lines, _, _ in batch for line in lines) + "\n").encode())
            except BaseException as exc:
                _fail([done for _, _, futures, _ in batch for done in futures], exc)
                raise
            self.files_written.extend(name for name, _, _, _ in batch)
            self.num_samples_written += sum(len(futures) for _, _, futures, _ in batch)
            self.num_tokens_written += sum(tokens for _, _, _, tokens in batch)
            for name, _, futures, _ in batch:
                for done in futures:
                    done.set_result(name)

    def _append_to_manifest(self, data: bytes) -> None:
        """Append whole lines and fsync. A failed append is cut back off, so the manifest lists exactly the
        samples counted; the renamed files of those lines are then unreferenced, and a rerun removes them."""
        fd = os.open(os.path.join(self.output_dir, MANIFEST), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    self._manifest_broken = True
                raise
        finally:
            os.close(fd)


def _fail(futures: list["Future[str]"], exc: BaseException) -> None:
    """Complete the futures of records that will not be written (those already done keep their result)."""
    for done in futures:
        if not done.done():
            done.set_exception(exc)
