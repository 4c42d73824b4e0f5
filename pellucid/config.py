"""Dataclass configs. `EngineConfig.from_kwargs` accepts the flat vLLM-style keyword names."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported only where a value is resolved (in the engine), not to build a config: `pellucid serve`
# builds its config and starts the engine process before it imports torch, so the two imports overlap.
_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "half": "float16", "fp16": "float16"}


def resolve_dtype(dtype: str | torch.dtype, device: str, config_dtype: torch.dtype | None = None) -> torch.dtype:
    """`auto` means the checkpoint's dtype on GPU and float32 on CPU (bf16 matmuls are slow on most CPUs)."""
    import torch
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cpu"):
            return torch.float32
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(sorted(_DTYPES))}")
    return getattr(torch, _DTYPES[dtype])


def resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for but CUDA is not available on this machine")
    return device


@dataclass
class ModelConfig:
    model: str                      # a HuggingFace-format directory
    tokenizer: str | None = None    # defaults to `model`
    dtype: str = "auto"
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None
    # Most top alternatives a request may ask for per position (logprobs, prompt_logprobs), as vLLM's
    # max_logprobs: each step's logprob tensor is as wide as its widest request, for every row, and copied to
    # the host, so one request must not make it vocabulary-wide for a whole batch. -1: the vocabulary.
    max_logprobs: int = 20
    # The stage of a multi-stage checkpoint this engine serves (Qwen3-Omni: "thinker", "talker", "code2wav");
    # None for a single model. A pipeline (pellucid.pipeline) sets it for each of its engines.
    submodel: str | None = None
    # vLLM's hf_overrides: fields set on the model's config.json as it is read (a nested dict updates a nested
    # config), e.g. {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}.
    hf_overrides: dict[str, Any] | None = None

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model

    def __post_init__(self) -> None:
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for the vocabulary, got {self.max_logprobs!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a dict of config fields, got {self.hf_overrides!r}")


# CacheConfig.kv_cache_dtype: the model's dtype, or FP8 (e4m3, also named fp8, or e5m2); pellucid/attention/kv_dtype.py
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    # None: on wherever the model supports it (EngineCore resolves it to a bool; hybrid models cannot).
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None        # explicit pool size; overrides memory-based sizing
    cpu_kv_cache_bytes: int = 1 << 30       # pool size on CPU when num_kv_blocks is not given
    kv_cache_dtype: str = "auto"            # KV_CACHE_DTYPES

    def __post_init__(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # defaults to max(2048, max_model_len) capped at 8192
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before step N is read back, so the host work of a step (scheduling,
    # batch building, output processing) runs while the device computes (see engine/scheduler.py).
    # None = on for CUDA devices (H100, Qwen3-0.6B shape: batch-1 decode 1.91 -> 1.39 ms/step, batch 256
    # 5.27 -> 3.50 ms), off on the CPU, where a launch is the computation itself and nothing overlaps,
    # and off under AsyncLLM / the server, whose streaming thread needs the GIL (see async_llm.py).
    async_scheduling: bool | None = None


@dataclass
class RunnerConfig:
    device: str = "auto"
    attention_backend: str = "auto"     # "torch" | "triton" | "auto" (triton on CUDA when importable)
    enforce_eager: bool = False         # disables CUDA graphs
    cuda_graph_sizes: list[int] | None = None
    # Run the engine core in its own process (True) or in the frontend's (False). None: a process for
    # AsyncLLM and the server, the caller's own thread for LLM (see pellucid/engine/core_client.py).
    engine_process: bool | None = None


ALL_REDUCES = ("nccl", "symm_mem")     # ParallelConfig.all_reduce


@dataclass
class ParallelConfig:
    # Shard the model over this many ranks (one GPU each; processes on the CPU), Megatron-style.
    tensor_parallel_size: int = 1
    # How ranks 1..N-1 start: "mp" (the engine starts a worker process per rank on this machine), "ray" (a
    # Ray actor per rank, on the nodes of a Ray cluster) or "env" (a launcher started every rank and set
    # torch.distributed's env:// variables: torchrun, across machines too). None: "env" when WORLD_SIZE is
    # set in the environment, else "mp".
    distributed_executor_backend: str | None = None
    # The all-reduce after each row-parallel layer: "nccl" (the process group's own: NCCL on CUDA, gloo on
    # the CPU) or "symm_mem" (torch's symmetric-memory one-shot kernel for small messages, NCCL for the
    # others; NCCL throughout, with the reason logged, where it cannot run). See docs/tensor_parallel.md.
    all_reduce: str = "nccl"

    def validate(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray", "env"):
            raise ValueError(f"distributed_executor_backend must be 'mp', 'ray' or 'env', got "
                             f"{self.distributed_executor_backend!r}")
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(f"all_reduce must be one of {', '.join(ALL_REDUCES)}, got {self.all_reduce!r}")


@dataclass
class HeadConfig:
    name: str = "dense"                 # "dense" | "flashhead" | a plugin from the pellucid.heads entry points
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # The engine core class that serves this config, as "module:Class" (a pipeline stage that is no LLM,
    # e.g. "pellucid.pipeline.code2wav_core:Code2WavCore"); None: pellucid.engine.engine_core.EngineCore.
    core: str | None = None

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments named as vLLM names them (max_model_len, max_num_seqs, ...)."""
        head = kwargs.pop("head", "dense")
        head_options = kwargs.pop("head_options", None) or {}
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "runner": RunnerConfig,
                    "parallel": ParallelConfig}
        values: dict[str, dict[str, Any]] = {name: {} for name in sections}
        for key, value in kwargs.items():
            owner = next((name for name, klass in sections.items()
                          if key in {f.name for f in dataclasses.fields(klass)}), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            values[owner][key] = value
        return cls(model=ModelConfig(model=model, **values["model"]),
                   cache=CacheConfig(**values["cache"]),
                   scheduler=SchedulerConfig(**values["scheduler"]),
                   runner=RunnerConfig(**values["runner"]),
                   head=HeadConfig(name=head, options=dict(head_options)),
                   parallel=ParallelConfig(**values["parallel"]))
