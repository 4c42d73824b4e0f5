"""Embeddings from a model's hidden states: the model's pooler and a request's pooling params
(config.py, light to import), and the frontends' embedding requests (embedder.py)."""
from pellucid.pooling.config import POOLING_TYPES, PoolerConfig, PoolingParams

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingParams"]
