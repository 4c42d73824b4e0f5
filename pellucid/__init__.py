"""Pellucid: a fast LLM inference and serving engine whose internals are open."""
from pellucid.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput,
                              EmbeddingRequestOutput, Logprob, RequestOutput, ScoringOutput, ScoringRequestOutput)
from pellucid.pooling import PoolingParams
from pellucid.sampling_params import SamplingParams
from pellucid.structured import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "SamplingParams", "StructuredOutputsParams", "PoolingParams", "RequestOutput", "CompletionOutput",
           "EmbeddingRequestOutput", "EmbeddingOutput", "ClassificationRequestOutput", "ClassificationOutput",
           "ScoringRequestOutput", "ScoringOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # Engines import torch and the model code; load them only when asked for.
    if name == "LLM":
        from pellucid.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from pellucid.engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(f"module 'pellucid' has no attribute {name!r}")
