"""The traceable sites of a model: which module inputs/outputs exist, and their per-token shapes.

A site is a module path (HuggingFace naming) plus a point. `input` is the module's first positional
argument, `output` its return value; both must be one tensor in the flat token layout [num_tokens, ...]
and the module must run once per forward (a module shared by several layers, such as a rotary
embedding, would give several values per token and is not a site). The table comes from one tiny
forward with hooks on every module, so it is right for any architecture rather than derived from
module types. `logits` (exact dense logits) and `tokens` (sampled ids) are added by the runner.
"""
from __future__ import annotations

import difflib
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pellucid.logger import get_logger
from pellucid.tracing.ops import LOGITS, TOKENS, Op

logger = get_logger(__name__)

_PROBE_TOKENS = 3   # > 1 so a leading dim equal to the token count is not confused with a size-1 dim


@dataclass(frozen=True)
class SiteInfo:
    name: str                   # "model.layers.0.output"
    module: str                 # "model.layers.0", or "logits" / "tokens"
    point: str                  # "input" | "output"
    shape: tuple[int, ...]      # per-token shape: the value for n tokens is [n, *shape]
    dtype: torch.dtype
    # The edit ops the site accepts (None: all). A module declares limits in `site_edit_kinds`
    # ({"output": ("scale", "zero")}) when other edits would have no meaning its consumer can honour.
    edit_kinds: tuple[str, ...] | None = None


class SiteTable:
    """Every valid (module, point) of one model with its per-token shape and dtype."""

    def __init__(self, sites: list[SiteInfo], unusable: dict[str, str]) -> None:
        self.sites = {s.name: s for s in sites}
        self.unusable = unusable    # "path.point" -> why it is not a site

    def get(self, site: str, point: str) -> SiteInfo:
        """The site, or ValueError naming it with the closest valid names."""
        name = f"{site}.{point}"
        if name in self.sites:
            return self.sites[name]
        if name in self.unusable:
            raise ValueError(f"{name} is not a traceable site: {self.unusable[name]}")
        raise ValueError(unknown_site_message(name, list(self.sites)))

    def check(self, op: Op) -> SiteInfo:
        site = self.get(op.site, op.point)
        if op.edits and site.edit_kinds is not None and op.kind not in site.edit_kinds:
            raise ValueError(f"{site.name} accepts save and the edits {', '.join(site.edit_kinds)}, not {op.kind}")
        return site

    def module_paths(self) -> set[str]:
        """Every module path of the model (traceable or not), for checking paths as a trace is built."""
        names = list(self.sites) + list(self.unusable)
        return {name.rsplit(".", 1)[0] for name in names} - {LOGITS, TOKENS}


def unknown_site_message(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else " (llm.sites() lists them)"
    return f"unknown site {name!r}{hint}"


_TABLES: "weakref.WeakKeyDictionary[nn.Module, SiteTable]" = weakref.WeakKeyDictionary()


def site_table(runner: Any) -> SiteTable:
    """The site table of a ModelRunner's model, probed once and cached. Call it from the thread that
    runs the engine's steps (it runs a forward)."""
    table = _TABLES.get(runner.model)
    if table is None:
        table = _probe(runner)
        _TABLES[runner.model] = table
    return table


def _probe(runner: Any) -> SiteTable:
    from pellucid.engine.request import Request
    from pellucid.engine.scheduler_output import SchedulerOutput
    from pellucid.runner.batch import build_step_batch
    from pellucid.runner.buffers import StepBuffers
    from pellucid.attention.metadata import ForwardContext, forward_context
    from pellucid.sampling_params import SamplingParams

    model: nn.Module = runner.model
    paths_of: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if path:
            paths_of.setdefault(id(module), []).append(path)
    modules = {path: module for path, module in model.named_modules() if path}

    calls: dict[str, int] = {}
    seen: dict[str, Any] = {}

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return (tuple(value.shape), value.dtype)
        return type(value).__name__

    def make_hooks(path: str) -> tuple[Any, Any]:
        def pre(_module: nn.Module, args: tuple[Any, ...]) -> None:
            calls[path] = calls.get(path, 0) + 1
            seen[f"{path}.input"] = describe(args[0]) if args else "no positional argument"

        def post(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            seen[f"{path}.output"] = describe(output)
        return pre, post

    block_size = runner.block_size
    num_blocks = math.ceil(_PROBE_TOKENS / block_size)
    kv_shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    kv_caches = [torch.zeros(kv_shape, dtype=runner.kv_dtype, device=runner.device)
                 for _ in range(model.num_attention_layers)]
    request = Request("site-probe", [0] * _PROBE_TOKENS, SamplingParams(max_tokens=1))
    request.block_ids = list(range(num_blocks))
    so = SchedulerOutput(requests=[request], num_scheduled_tokens=[_PROBE_TOKENS], num_computed_tokens=[0],
                         samples=[True])
    batch = build_step_batch(so, StepBuffers(_PROBE_TOKENS, 1, num_blocks, runner.device), block_size)
    state_pool = getattr(runner, "state_pool", None)   # recurrent-state models need scratch state too
    extras = dict(state_pool.scratch_extras(1)) if state_pool is not None else {}
    ctx = ForwardContext(attn_metadata=batch.attn, backend=runner.backend,
                         backend_metadata=runner.backend.build_metadata(batch.attn), kv_caches=kv_caches,
                         positions=batch.positions, token_to_req=batch.token_to_req, extras=extras)
    handles = []
    try:
        for path, module in modules.items():
            pre, post = make_hooks(path)
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
        with torch.inference_mode(), forward_context(ctx):
            hidden = model(batch.input_ids)
    finally:
        for handle in handles:
            handle.remove()

    sites: list[SiteInfo] = []
    unusable: dict[str, str] = {}
    for path, module in modules.items():
        for point in ("input", "output"):
            name = f"{path}.{point}"
            if len(paths_of[id(module)]) > 1:
                unusable[name] = (f"the module is shared by {len(paths_of[id(module)])} paths "
                                  f"({', '.join(paths_of[id(module)][:3])}...) and runs several times per forward")
            elif path not in calls:
                unusable[name] = ("the module is not called in the forward" +
                                  ("; its output is the site 'logits' and its input is model.norm.output"
                                   if path == "lm_head" else ""))
            elif calls[path] > 1:
                unusable[name] = f"the module runs {calls[path]} times per forward"
            else:
                found = seen[name]
                if not isinstance(found, tuple) or not found[0] or found[0][0] != _PROBE_TOKENS:
                    unusable[name] = (f"its value is {found!r}, not one tensor in the flat token layout "
                                      f"[num_tokens, ...]")
                else:
                    kinds = getattr(module, "site_edit_kinds", {}).get(point)
                    sites.append(SiteInfo(name, path, point, _full_shape(module, point, found[0][1:]), found[1],
                                          None if kinds is None else tuple(kinds)))
    vocab = runner.head.vocab_size
    sites.append(SiteInfo(f"{LOGITS}.output", LOGITS, "output", (vocab,), torch.float32))
    sites.append(SiteInfo(f"{TOKENS}.output", TOKENS, "output", (), torch.int64))
    del hidden
    logger.debug("traceable sites: %d (%d module points not traceable)", len(sites), len(unusable))
    return SiteTable(sites, unusable)


def _full_shape(module: nn.Module, point: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The per-token shape of the full value where a tensor-parallel rank holds part of it (its first dim:
    parallel_layers.py `tp_sites`); a trace sees the full value (tracing/taps.py gathers it)."""
    shard = getattr(module, "tp_sites", {}).get(point)
    if shard is None:
        return shape
    return (shape[0] // shard.length * shard.total, *shape[1:])


def module_paths(model: nn.Module) -> set[str]:
    """Every module path of a model (no forward), for immediate checks while building a trace."""
    return {path for path, _ in model.named_modules() if path}
