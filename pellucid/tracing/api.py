"""The offline tracing API: `with llm.trace(prompts, params) as tr:` builds ops, leaving the block runs them.

    with llm.trace(["The quick brown fox"]) as tr:
        h = tr.model.layers[1].output.save()          # h[i]: request i's [tokens, hidden]
        tr.model.layers[0].mlp.output.scale(0.0)
        with tr.invoke("Another prompt"):              # ops in here apply to this prompt only
            tr.model.layers[0].output.add(vector, positions="last")
    h[0]

Attribute and index access build module paths (`tr.model.layers[3].self_attn.o_proj`); an unknown
path fails at once with the closest names. Nothing runs until the block ends; then every request
goes through the engine as one batch, alongside whatever else the engine is running. A request whose
op fails raises TraceError at the block boundary (the others still complete).
"""
from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any, Callable, Iterator, Sequence

import torch

from pellucid.outputs import RequestOutput
from pellucid.sampling_params import SamplingParams
from pellucid.tracing.ops import LOGITS, TOKENS, Add, Apply, MeanAblate, Op, Save, Scale, Set, Zero
from pellucid.tracing.plan import TRACE_KEY, TracePlan
from pellucid.tracing.sites import SiteTable, unknown_site_message


class TraceError(RuntimeError):
    """Some requests of a trace failed. `failures[i] = (message, traceback)` for request i; `outputs`
    holds every RequestOutput and the saves of the requests that succeeded are filled in."""

    def __init__(self, failures: dict[int, tuple[str, str | None]], outputs: list[RequestOutput]) -> None:
        lines = [f"{len(failures)} of {len(outputs)} traced requests failed:"]
        for index, (message, tb) in failures.items():
            lines.append(f"  request {index}: {message}")
            if tb:
                lines.append("    " + tb.rstrip().replace("\n", "\n    "))
        super().__init__("\n".join(lines))
        self.failures = failures
        self.outputs = outputs


class UnknownSiteError(AttributeError):
    """An attribute or index that names no module of the model."""


class SaveHandle:
    """Saved values, one tensor per request the save applies to: `h[i]` is `[positions, *site_shape]`."""

    def __init__(self, name: str, target: str) -> None:
        self.name = name
        self.target = target
        self.request_indices: list[int] = []
        self._values: list[torch.Tensor | None] | None = None
        self._positions: list[list[int] | None] | None = None

    def _fill(self, values: list[torch.Tensor | None], positions: list[list[int] | None]) -> None:
        self._values, self._positions = values, positions

    def _ready(self) -> list[torch.Tensor | None]:
        if self._values is None:
            raise RuntimeError(f"save {self.name!r} has no value yet: values exist once the trace block has ended")
        return self._values

    def __getitem__(self, index: int) -> torch.Tensor:
        value = self._ready()[index]
        if value is None:
            raise RuntimeError(f"save {self.name!r}: request {index} of this save failed (see the TraceError)")
        return value

    def __len__(self) -> int:
        return len(self._ready())

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    @property
    def value(self) -> torch.Tensor:
        """The value when the save applies to exactly one request."""
        values = self._ready()
        if len(values) != 1:
            raise RuntimeError(f"save {self.name!r} applies to {len(values)} requests; index it instead of .value")
        return self[0]

    def positions(self, index: int) -> list[int]:
        """The token positions of `self[index]`'s rows."""
        self._ready()
        assert self._positions is not None
        return self._positions[index] or []

    def __repr__(self) -> str:
        state = "pending" if self._values is None else f"{len(self._values)} values"
        return f"SaveHandle({self.name!r} at {self.target}, {state})"


class Point:
    """`module.input` or `module.output` (or `logits` / `tokens`): the ops you can put there."""

    def __init__(self, trace: "Trace", site: str, point: str) -> None:
        self._trace = trace
        self._site = site
        self._point = point

    def save(self, name: str | None = None, positions: Any = None, phase: Any = "all") -> SaveHandle:
        return self._trace._add_save(Save(site=self._site, point=self._point, positions=positions, phase=phase,
                                          name=name))

    def set(self, value: Any, positions: Any = None, phase: Any = "all") -> None:
        self._trace._add(Set(site=self._site, point=self._point, value=value, positions=positions, phase=phase))

    def add(self, value: Any, positions: Any = None, phase: Any = "all") -> None:
        self._trace._add(Add(site=self._site, point=self._point, value=value, positions=positions, phase=phase))

    def scale(self, factor: Any, positions: Any = None, phase: Any = "all") -> None:
        self._trace._add(Scale(site=self._site, point=self._point, factor=factor, positions=positions, phase=phase))

    def zero(self, positions: Any = None, phase: Any = "all") -> None:
        self._trace._add(Zero(site=self._site, point=self._point, positions=positions, phase=phase))

    def mean_ablate(self, mean: Any, positions: Any = None, phase: Any = "all") -> None:
        self._trace._add(MeanAblate(site=self._site, point=self._point, mean=mean, positions=positions,
                                    phase=phase))

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor | None], positions: Any = None,
              phase: Any = "all") -> None:
        self._trace._add(Apply(site=self._site, point=self._point, fn=fn, positions=positions, phase=phase))

    def __repr__(self) -> str:
        return f"<site {self._site}.{self._point}>"


class ModuleProxy:
    """A module path being built: attributes and indices extend it, `.input` / `.output` end it."""

    def __init__(self, trace: "Trace", path: str) -> None:
        self._trace = trace
        self._path = path

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("input", "output"):
            return self._trace._point(self._path, name)
        return self._trace._module(f"{self._path}.{name}")

    def __getitem__(self, index: int) -> "ModuleProxy":
        if not isinstance(index, int):
            raise TypeError(f"{self._path}[...] takes an integer index, got {type(index).__name__}")
        if index < 0:
            children = self._trace._children(self._path)
            if not -len(children) <= index:
                raise IndexError(f"{self._path} has {len(children)} entries, index {index} is out of range")
            index += len(children)
        return self._trace._module(f"{self._path}.{index}")

    def __repr__(self) -> str:
        return f"<module {self._path}>"


class Trace:
    """Collects ops and requests; `run` (by the context manager that made it) executes them."""

    def __init__(self, table: SiteTable, prompts: Any, sampling_params: Any) -> None:
        from pellucid.llm import normalize_prompts

        self._normalize = normalize_prompts
        self._paths = table.module_paths()
        self._check_site = table.get
        self._prompts: list[Any] = normalize_prompts(prompts) if prompts is not None else []
        if sampling_params is None:
            sampling_params = SamplingParams(temperature=0.0, max_tokens=1)
        if isinstance(sampling_params, SamplingParams):
            self._default_params = sampling_params
            self._params = [sampling_params] * len(self._prompts)
        else:
            self._params = list(sampling_params)
            if len(self._params) != len(self._prompts):
                raise ValueError(f"got {len(self._params)} sampling params for {len(self._prompts)} prompts")
            self._default_params = SamplingParams(temperature=0.0, max_tokens=1)
        self._ops: list[tuple[Op, int | None]] = []     # (op, invoke id or None for every request)
        self._invokes: list[list[int]] = []             # invoke id -> its request indices
        self._current_invoke: int | None = None
        self._handles: list[tuple[SaveHandle, int | None]] = []
        self._names: set[str] = set()
        self.outputs: list[RequestOutput] = []

    # ---- building ---------------------------------------------------------------------------------
    @property
    def model(self) -> ModuleProxy:
        return self._module("model")

    @property
    def lm_head(self) -> ModuleProxy:
        return self._module("lm_head")

    def __getattr__(self, name: str) -> ModuleProxy:
        """Any other top-level module by its HF name (Qwen3-Omni's thinker stage: `tr.thinker.model...`)."""
        if name.startswith("_") or name not in self.__dict__.get("_paths", ()):
            raise AttributeError(f"{type(self).__name__} has no attribute or top-level module {name!r}")
        return self._module(name)

    @property
    def logits(self) -> Point:
        """Exact full-vocabulary logits (float32) at each selected position."""
        return Point(self, LOGITS, "output")

    @property
    def tokens(self) -> Point:
        """The token id sampled at each selected position (save only)."""
        return Point(self, TOKENS, "output")

    @contextlib.contextmanager
    def invoke(self, prompts: Any, sampling_params: SamplingParams | None = None) -> Iterator["Trace"]:
        """Add prompt(s) whose ops are the ones made inside this block (plus the trace-wide ones)."""
        if self._current_invoke is not None:
            raise RuntimeError("invoke blocks do not nest")
        new = self._normalize(prompts)
        start = len(self._prompts)
        self._prompts.extend(new)
        self._params.extend([sampling_params or self._default_params] * len(new))
        self._invokes.append(list(range(start, start + len(new))))
        self._current_invoke = len(self._invokes) - 1
        try:
            yield self
        finally:
            self._current_invoke = None

    def cache(self, sites: Sequence[str] | None = None, point: str = "output", positions: Any = None,
              phase: Any = "all") -> dict[str, SaveHandle]:
        """Save many sites at once: {site: handle}; by default every decoder layer's output."""
        if sites is None:
            pattern = re.compile(r"^model\.layers\.\d+$")
            sites = sorted((p for p in self._paths if pattern.match(p)), key=lambda p: int(p.rsplit(".", 1)[1]))
        cache = {}
        for site in sites:
            if site not in (LOGITS, TOKENS):
                self._check_path(site)
            cache[site] = self._point(site, point).save(positions=positions, phase=phase)
        return cache

    def _module(self, path: str) -> ModuleProxy:
        self._check_path(path)
        return ModuleProxy(self, path)

    def _check_path(self, path: str) -> None:
        if path not in self._paths:
            raise UnknownSiteError(unknown_site_message(path, sorted(self._paths)))

    def _children(self, path: str) -> list[str]:
        prefix = path + "."
        return [p for p in self._paths if p.startswith(prefix) and "." not in p[len(prefix):]]

    def _point(self, site: str, point: str) -> Point:
        try:
            self._check_site("logits" if site == "lm_head" and point == "output" else site, point)
        except ValueError as exc:
            raise UnknownSiteError(str(exc)) from None
        return Point(self, site, point)

    def _add(self, op: Op) -> None:
        self._ops.append((op, self._current_invoke))

    def _add_save(self, op: Save) -> SaveHandle:
        name = op.name if op.name is not None else f"{op.target}#{len(self._handles)}"
        if name in self._names:
            raise ValueError(f"a save named {name!r} already exists in this trace")
        self._names.add(name)
        op.name = name
        handle = SaveHandle(name, op.target)
        self._handles.append((handle, self._current_invoke))
        self._add(op)
        return handle

    # ---- running ----------------------------------------------------------------------------------
    def _requests(self) -> tuple[list[Any], list[SamplingParams], list[dict[str, Any] | None]]:
        if not self._prompts:
            raise ValueError("the trace has no prompts: pass prompts to trace() or use tr.invoke(prompt)")
        invoke_of = {i: inv for inv, members in enumerate(self._invokes) for i in members}
        extras: list[dict[str, Any] | None] = []
        for i in range(len(self._prompts)):
            ops = [op for op, scope in self._ops if scope is None or scope == invoke_of.get(i)]
            extras.append({TRACE_KEY: TracePlan(ops)} if ops else None)
        return self._prompts, self._params, extras

    def _collect(self, outputs: list[RequestOutput], errors: dict[int, str] | None = None) -> None:
        """Fill the save handles from the outputs; raise TraceError if any request failed."""
        self.outputs = outputs
        errors = dict(errors or {})
        failures: dict[int, tuple[str, str | None]] = {}
        for i, out in enumerate(outputs):
            message = errors.get(i) or (out.error if out is not None else None)
            if message:
                info = (out.extras.get("trace_error") if out is not None else None) or {}
                failures[i] = (info.get("message") or message, info.get("traceback"))
        for handle, scope in self._handles:
            members = list(range(len(outputs))) if scope is None else self._invokes[scope]
            handle.request_indices = members
            values, positions = [], []
            for i in members:
                out = outputs[i]
                saves = out.extras.get("saves") if (out is not None and i not in failures) else None
                values.append(saves[handle.name] if saves is not None else None)
                positions.append(out.extras["save_positions"][handle.name] if saves is not None else None)
            handle._fill(values, positions)
        if failures:
            raise TraceError(failures, outputs)


@contextlib.contextmanager
def trace(llm: Any, prompts: Any = None, sampling_params: Any = None) -> Iterator[Trace]:
    """`llm.trace(...)`: build ops in the block; on leaving it, run every request through the engine."""
    tr = Trace(llm.info.site_table, prompts, sampling_params)
    yield tr
    prompts_list, params, extras = tr._requests()
    outputs = llm.generate(prompts_list, params, use_tqdm=False, extras=extras)
    tr._collect(outputs)


class async_trace:
    """`async with async_trace(async_llm, prompts, params) as tr:` the same API over an AsyncLLM: every
    request (every invoke) runs concurrently, and the block ends when all of them have finished."""

    def __init__(self, async_llm: Any, prompts: Any = None, sampling_params: Any = None) -> None:
        self._llm = async_llm
        self._trace = Trace(async_llm.info.site_table, prompts, sampling_params)

    async def __aenter__(self) -> Trace:
        return self._trace

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            return
        from pellucid.engine.async_llm import RequestFailedError

        prompts, params, extras = self._trace._requests()
        errors: dict[int, str] = {}

        async def one(i: int) -> RequestOutput | None:
            final = None
            try:
                async for output in self._llm.generate(prompts[i], params[i], extras=extras[i]):
                    final = output
            except RequestFailedError as failure:
                errors[i] = failure.message
            return final

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            # A request refused when added (ValueError: a bad op) or this block cancelled: the other requests
            # of the trace end too (leaving generate() aborts a request) instead of running on unobserved.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self._trace._collect(list(outputs), errors)
