"""Tensor-parallel ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`), on any node of a Ray
cluster.

Rank 0 stays in the engine-core process, which becomes a Ray driver: it joins the cluster that
`RAY_ADDRESS` (or a running local cluster) names, else starts a local one. The ranks are placed with one
placement group: bundle 0 is pinned to the engine's node and holds rank 0's GPU (an idle actor keeps it
reserved, and rank 0 uses the GPU Ray gave that actor), bundles 1..N-1 each get a worker actor, which runs
the same worker loop as the local worker processes (pellucid.distributed.worker) with its channels and
rendezvous over TCP. On the CPU the bundles are CPUs.

Ray owns the actors' processes: they end with their owner, the engine process, however it ends.

A Ray worker process does not inherit the engine process's environment (the raylet of its node starts it,
on another machine, or from a cluster started before the engine), so each actor is given the engine's
`PELLUCID_` variables (environment.py): every rank runs the kernels and logging the user asked for.
"""
from __future__ import annotations

import socket
from typing import Any

import torch

from pellucid.child_process import on_abrupt_exit
from pellucid.distributed.environment import rank_environment
from pellucid.distributed.parallel_state import TensorParallelStartupError
from pellucid.logger import get_logger

logger = get_logger(__name__)


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise TensorParallelStartupError(
            "distributed_executor_backend='ray' needs Ray: pip install 'pellucid[ray]' (or ray)") from exc
    return ray


class RankActor:
    """A Ray actor hosting one worker rank (made remote in RayRanks, so Ray stays an optional import)."""

    def node_and_gpus(self) -> tuple[str, list[str]]:
        import ray
        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def run(self, settings: Any) -> None:
        """Serve steps until rank 0 says stop (returns) or this rank fails (raises, after reporting it)."""
        from pellucid.distributed.worker import serve_worker_rank
        serve_worker_rank(settings)


class RayWorker:
    """One worker rank seen from rank 0: its actor and the pending result of its `run`."""

    def __init__(self, ray: Any, actor: Any, result: Any) -> None:
        self.ray = ray
        self.actor = actor
        self.result = result

    def exit_reason(self) -> str | None:
        """None while the rank runs; else how it ended, as 'worker rank r ...' continues."""
        ready, _ = self.ray.wait([self.result], timeout=0)
        if not ready:
            return None
        try:
            self.ray.get(self.result)
        except self.ray.exceptions.RayActorError as exc:
            return f"(a Ray actor) died: {_first_line(exc)}"
        except Exception as exc:       # the rank's own error: it reported it already, this is the fallback
            return f"(a Ray actor) failed: {_first_line(exc)}"
        return "(a Ray actor) stopped"

    def stop(self, timeout: float) -> None:
        """After Stop: wait for its loop to return (up to `timeout`), then end the actor (an idle actor
        would keep its process and its bundle's GPU)."""
        self.ray.wait([self.result], timeout=max(0.0, timeout))
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception:       # already gone
            logger.debug("killing a Ray worker actor failed", exc_info=True)


class RayRanks:
    """The Ray side of a tensor-parallel engine: the cluster connection, the placement group, rank 0's GPU."""

    def __init__(self, size: int, device: torch.device, timeout_s: float) -> None:
        self.ray = import_ray()
        self.size = size
        # Joins RAY_ADDRESS's cluster or a running local one, else starts a local one (owned by this process;
        # ray.shutdown ends it).
        self.connected_here = not self.ray.is_initialized()
        self._undo_exit_hook = lambda: None
        if self.connected_here:
            self.ray.init(log_to_driver=True)
            # An engine process that exits at once (its frontend gone, a worker dead) skips atexit, and a local
            # cluster's agents would outlive it by a minute or more.
            self._undo_exit_hook = on_abrupt_exit(self.ray.shutdown)
        self.holder: Any = None
        self.group: Any = None
        try:
            self._place(size, device, timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, size: int, device: torch.device, timeout_s: float) -> None:
        """The placement group, and rank 0's bundle held by an idle actor on this node."""
        self.use_gpus = device.type == "cuda"
        resource = "GPU" if self.use_gpus else "CPU"
        available = self.ray.cluster_resources().get(resource, 0)
        if available < size:
            raise TensorParallelStartupError(
                f"tensor_parallel_size={size} needs {size} {resource}s in the Ray cluster, it has {available:g}")
        self.node_ip = self.ray.util.get_node_ip_address()
        from ray.util.placement_group import placement_group
        bundles = [{resource: 1, f"node:{self.node_ip}": 0.001}] + [{resource: 1} for _ in range(size - 1)]
        self.group = placement_group(bundles, strategy="PACK")
        try:
            self.ray.get(self.group.ready(), timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise TensorParallelStartupError(
                f"the Ray cluster could not place {size} bundles of one {resource} within {timeout_s:.0f} s "
                f"(resources: {self.ray.available_resources()})") from None
        self.actor_class = self.ray.remote(RankActor)
        self.holder = self._actor(0)
        node, gpus = self.ray.get(self.holder.node_and_gpus.remote(), timeout=timeout_s)
        if node != self.node_ip:
            raise TensorParallelStartupError(f"Ray placed rank 0's bundle on {node}, not on the engine's node "
                                             f"{self.node_ip}")
        if self.use_gpus:
            # Rank 0 uses the GPU Ray reserved for its bundle; the engine process sees the node's GPUs as Ray does.
            self.rank0_device = torch.device("cuda", int(gpus[0]))
        else:
            self.rank0_device = torch.device("cpu")

    def _actor(self, bundle: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.group, placement_group_bundle_index=bundle)
        resources = {"num_gpus": 1, "num_cpus": 0} if self.use_gpus else {"num_cpus": 1}
        return self.actor_class.options(scheduling_strategy=strategy, runtime_env={"env_vars": rank_environment()},
                                        **resources).remote()

    def start_worker(self, settings: Any) -> RayWorker:
        """Rank settings.rank in bundle settings.rank; its device is the one GPU Ray shows it (or the CPU)."""
        actor = self._actor(settings.rank)
        return RayWorker(self.ray, actor, actor.run.remote(settings))

    def shutdown(self) -> None:
        try:
            if self.holder is not None:
                self.ray.kill(self.holder, no_restart=True)
            if self.group is not None:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.group)
        except Exception:      # the cluster is gone already
            logger.debug("releasing the Ray placement group failed", exc_info=True)
        if self.connected_here:
            self._undo_exit_hook()
            self.ray.shutdown()


def free_tcp_port() -> int:
    """A port free on this machine now, for the rendezvous (torch's TCP store binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
