"""Declarative trace operations: what to read or change at one site, for which positions.

An op names a site (a HuggingFace module path such as `model.layers.3.mlp`, or `logits` / `tokens`),
a point (`input`: the module's first positional argument, or `output`) and a selector (positions and
phase, see selectors.py). Every op except `Apply` serializes to JSON, so the same interventions can be
sent to the server; tensors travel as base64 safetensors bytes.

Edit values (`Set`, `Add`, `MeanAblate`) either broadcast against one token's activation (shape
`[hidden]`, or anything that broadcasts to the site's per-token shape), or carry one row per selected
position (shape `[num_selected_positions, *per_token_shape]`, row j for the j-th selected position in
increasing order). Values are cast to the activation's dtype and device.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from pellucid.tracing.selectors import Selector
from pellucid.tracing.serialization import b64_to_tensors, tensors_to_b64

POINTS = ("input", "output")
LOGITS = "logits"
TOKENS = "tokens"
# `lm_head` is applied by the runner's LM head object, not called as a module: its output is `logits`.
SITE_ALIASES = {"lm_head": LOGITS}


@dataclass(kw_only=True)
class Op:
    site: str
    point: str = "output"
    positions: Any = None
    phase: Any = "all"
    selector: Selector = field(init=False, repr=False, compare=False)

    kind: ClassVar[str] = ""
    edits: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or not self.site:
            raise ValueError(f"site must be a non-empty module path string, got {self.site!r}")
        if self.point not in POINTS:
            raise ValueError(f"point must be 'input' or 'output', got {self.point!r}")
        if self.site in SITE_ALIASES and self.point == "output":
            self.site = SITE_ALIASES[self.site]
        if self.site in (LOGITS, TOKENS) and self.point != "output":
            raise ValueError(f"site {self.site!r} has only an output (the final hidden state, the LM head's input, "
                             f"is model.norm.output)")
        if self.site == TOKENS and self.edits:
            raise ValueError("site 'tokens' (the sampled token ids) supports only save")
        self.selector = Selector.make(self.positions, self.phase)

    @property
    def target(self) -> str:
        return f"{self.site}.{self.point}"

    def describe(self) -> str:
        return f"{self.kind} at {self.target} ({self.selector.describe()})"

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        """New values for `rows` [n, ...] (one request's selected rows); `ranks[i]` is row i's index among
        the op's `num_selected` selected positions. Only edit ops implement this."""
        raise NotImplementedError(f"{self.kind} does not edit")

    def check_fits(self, per_token_shape: tuple[int, ...], num_selected: int) -> None:
        """ValueError unless the op's tensor (if any) fits a site of this per-token shape where the op selects
        `num_selected` positions. Plans call it when bound to a request, so a misfit is refused up front."""

    # ---- JSON -----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"op": self.kind, "site": self.site, "point": self.point,
                                "positions": self.selector.positions_json(), "phase": self.selector.phase_json()}
        body.update(self._payload_json())
        return body

    def _payload_json(self) -> dict[str, Any]:
        return {}


@dataclass(kw_only=True)
class Save(Op):
    """Copy the selected rows; the request's output carries them stacked in position order."""

    name: str | None = None
    kind: ClassVar[str] = "save"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"save name must be a non-empty string, got {self.name!r}")

    def _payload_json(self) -> dict[str, Any]:
        return {"name": self.name}


class _ValueEdit(Op):
    """Shared by the edits that carry a tensor (in the field named by `value_field`), checked at construction."""

    edits: ClassVar[bool] = True
    value_field: ClassVar[str] = "value"

    def __post_init__(self) -> None:
        super().__post_init__()
        value = _as_tensor(getattr(self, self.value_field), self.value_field)
        setattr(self, self.value_field, value)
        self._device_values: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._fits: set[tuple[tuple[int, ...], int]] = set()    # (per-token shape, selected count) checked

    def has_rows(self, per_token_shape: tuple[int, ...]) -> bool:
        """True when the value carries one row per selected position rather than one token's value."""
        return getattr(self, self.value_field).dim() == len(per_token_shape) + 1

    def check_fits(self, per_token_shape: tuple[int, ...], num_selected: int) -> None:
        value = getattr(self, self.value_field)
        if self.has_rows(per_token_shape):
            if value.shape[0] != num_selected:
                raise ValueError(f"{self.kind} {self.value_field} has {value.shape[0]} rows (one per selected "
                                 f"position) but the op selects {num_selected} positions of this request")
            expected = (num_selected, *per_token_shape)
            fits = broadcasts_to(tuple(value.shape[1:]), per_token_shape)
        else:
            expected = per_token_shape
            fits = broadcasts_to(tuple(value.shape), per_token_shape)
        if not fits:
            raise ValueError(f"{self.kind} {self.value_field} of shape {tuple(value.shape)} does not fit "
                             f"{self.target}, whose per-token shape is {tuple(per_token_shape)} (expected "
                             f"{tuple(expected)} or a shape that broadcasts to it)")

    def _value_rows(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        """The value for each selected row, on the rows' device and dtype, broadcastable to rows."""
        key = (rows.device, rows.dtype)
        value = self._device_values.get(key)
        if value is None:
            value = getattr(self, self.value_field).to(device=rows.device, dtype=rows.dtype)
            self._device_values[key] = value
        per_token = tuple(rows.shape[1:])
        if (per_token, num_selected) not in self._fits:
            self.check_fits(per_token, num_selected)
            self._fits.add((per_token, num_selected))
        if self.has_rows(per_token):
            value = value[torch.as_tensor(ranks, device=value.device)]
        return value

    def _payload_json(self) -> dict[str, Any]:
        return {self.value_field: tensors_to_b64({self.value_field: getattr(self, self.value_field)})}


@dataclass(kw_only=True)
class Set(_ValueEdit):
    value: torch.Tensor
    kind: ClassVar[str] = "set"

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        return self._value_rows(rows, ranks, num_selected).expand_as(rows)


@dataclass(kw_only=True)
class Add(_ValueEdit):
    value: torch.Tensor
    kind: ClassVar[str] = "add"

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        return rows + self._value_rows(rows, ranks, num_selected)


@dataclass(kw_only=True)
class MeanAblate(_ValueEdit):
    """Replace the activation by a given mean (e.g. its average over a reference dataset)."""

    mean: torch.Tensor
    kind: ClassVar[str] = "mean_ablate"
    value_field: ClassVar[str] = "mean"

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        return self._value_rows(rows, ranks, num_selected).expand_as(rows)


@dataclass(kw_only=True)
class Scale(Op):
    """Multiply by `factor`: a number, or a tensor that broadcasts to one token's activation (a factor per
    unit: 0 at one expert of a routing decision ablates that expert, 0 at one head's slice of the attention
    output ablates that head). A tensor factor runs on the per-request path (no tap, no CUDA graph)."""

    factor: float | torch.Tensor
    kind: ClassVar[str] = "scale"
    edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.factor, (torch.Tensor, list, tuple)):
            factor = _as_tensor(self.factor, "scale factor")
            self.factor = float(factor) if factor.dim() == 0 else factor
            self._device_factors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        elif isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            raise ValueError(f"scale factor must be a number or a tensor, got {self.factor!r}")
        else:
            self.factor = float(self.factor)

    @property
    def per_unit(self) -> bool:
        """True for a tensor factor (one per element of a token's activation)."""
        return isinstance(self.factor, torch.Tensor)

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        if not isinstance(self.factor, torch.Tensor):
            return rows * self.factor
        key = (rows.device, rows.dtype)
        factor = self._device_factors.get(key)
        if factor is None:
            factor = self._device_factors[key] = self.factor.to(device=rows.device, dtype=rows.dtype)
        self.check_fits(tuple(rows.shape[1:]), num_selected)
        return rows * factor

    def check_fits(self, per_token_shape: tuple[int, ...], num_selected: int) -> None:
        if isinstance(self.factor, torch.Tensor) and not broadcasts_to(tuple(self.factor.shape), per_token_shape):
            raise ValueError(f"scale factor of shape {tuple(self.factor.shape)} does not fit {self.target}, whose "
                             f"per-token shape is {tuple(per_token_shape)} (expected that shape or one that "
                             f"broadcasts to it)")

    def _payload_json(self) -> dict[str, Any]:
        if isinstance(self.factor, torch.Tensor):
            return {"factor": tensors_to_b64({"factor": self.factor})}
        return {"factor": self.factor}


@dataclass(kw_only=True)
class Zero(Op):
    """Zero ablation."""

    kind: ClassVar[str] = "zero"
    edits: ClassVar[bool] = True

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        return torch.zeros_like(rows)


@dataclass(kw_only=True)
class Apply(Op):
    """`fn(rows) -> new rows` (same shape and dtype) or None after editing `rows` in place. Offline only:
    it runs arbitrary Python, so it does not serialize and the server refuses it."""

    fn: Callable[[torch.Tensor], torch.Tensor | None]
    kind: ClassVar[str] = "apply"
    edits: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not callable(self.fn):
            raise ValueError(f"apply needs a callable, got {type(self.fn).__name__}")

    def edit(self, rows: torch.Tensor, ranks: np.ndarray, num_selected: int) -> torch.Tensor:
        result = self.fn(rows)
        if result is None:
            return rows
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"apply fn at {self.target} returned {type(result).__name__}, expected a tensor or None")
        if result.shape != rows.shape or result.dtype != rows.dtype:
            raise ValueError(f"apply fn at {self.target} returned {tuple(result.shape)} {result.dtype}, expected "
                             f"{tuple(rows.shape)} {rows.dtype} (the shape and dtype of its input)")
        return result

    def to_json(self) -> dict[str, Any]:
        raise ValueError("op 'apply' runs Python code: it is offline only and cannot be serialized")


def broadcasts_to(source: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of shape `source` broadcasts to exactly `target` (torch.broadcast_shapes rules,
    without its cost: this runs once per traced request and op)."""
    return len(source) <= len(target) and all(a in (1, b) for a, b in zip(reversed(source), reversed(target)))


OP_TYPES: dict[str, type[Op]] = {cls.kind: cls for cls in (Save, Set, Add, Scale, Zero, MeanAblate, Apply)}
_COMMON_FIELDS = {"op", "site", "point", "positions", "phase"}


def op_from_json(body: Any) -> Op:
    """One op from its JSON object; ValueError naming the problem (unknown op, field, bad tensor...)."""
    if not isinstance(body, dict):
        raise ValueError(f"an intervention must be a JSON object, got {type(body).__name__}")
    kind = body.get("op")
    if kind == "apply":
        raise ValueError("op 'apply' runs Python code and is offline only; the server never executes code "
                         "from a request")
    if kind not in OP_TYPES:
        raise ValueError(f"unknown op {kind!r}; choose one of {', '.join(k for k in OP_TYPES if k != 'apply')}")
    cls = OP_TYPES[kind]
    own = {f.name for f in dataclasses.fields(cls) if f.init} - {"site", "point", "positions", "phase"}
    unknown = set(body) - _COMMON_FIELDS - own
    if unknown:
        raise ValueError(f"op {kind!r} has no field(s) {sorted(unknown)}; it takes "
                         f"{sorted(_COMMON_FIELDS - {'op'} | own)}")
    if "site" not in body:
        raise ValueError(f"op {kind!r} needs a 'site' (a module path such as 'model.layers.0', or 'logits')")
    kwargs = {k: v for k, v in body.items() if k != "op"}
    for name in ("value", "mean"):
        if name in own:
            if name not in kwargs:
                raise ValueError(f"op {kind!r} needs a {name!r} (base64 safetensors or a list of numbers)")
            kwargs[name] = _tensor_from_json(kwargs[name], name)
    if kind == "scale" and "factor" not in kwargs:
        raise ValueError("op 'scale' needs a 'factor'")
    if kind == "scale" and isinstance(kwargs["factor"], (str, list)):
        try:
            kwargs["factor"] = _tensor_from_json(kwargs["factor"], "factor")
        except ValueError as exc:
            raise ValueError(f"scale factor must be a number, a list of numbers or base64 safetensors holding one "
                             f"tensor: {exc}") from exc
    if kwargs.get("point") is None:
        kwargs.pop("point", None)
    if kwargs.get("phase") is None:
        kwargs.pop("phase", None)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"op {kind!r}: {exc}") from exc


def ops_from_json(items: Any) -> list[Op]:
    if not isinstance(items, list):
        raise ValueError(f"interventions must be a list of op objects, got {type(items).__name__}")
    ops = []
    for i, item in enumerate(items):
        try:
            ops.append(op_from_json(item))
        except ValueError as exc:
            raise ValueError(f"interventions[{i}]: {exc}") from exc
    return ops


def ops_to_json(ops: list[Op]) -> list[dict[str, Any]]:
    return [op.to_json() for op in ops]


def _tensor_from_json(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, str):
        tensors = b64_to_tensors(value)
        if len(tensors) != 1:
            raise ValueError(f"{name} must hold exactly one tensor, got {sorted(tensors)}")
        return next(iter(tensors.values()))
    if isinstance(value, list):
        try:
            return torch.tensor(value, dtype=torch.float32)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} is not a (nested) list of numbers: {exc}") from exc
    raise ValueError(f"{name} must be base64 safetensors bytes or a list of numbers, got {type(value).__name__}")


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, (list, tuple, int, float)) and not isinstance(value, bool):
        value = torch.tensor(value, dtype=torch.float32)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
    return value.detach()
