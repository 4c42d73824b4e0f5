"""Tensor parallelism on torch.distributed: this process's rank, the sharded layers' collectives, the
worker processes of ranks 1..N-1 and the messages that drive them (see docs/tensor_parallel.md)."""
