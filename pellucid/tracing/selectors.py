"""Which token positions of a request an op touches: a position selector intersected with a phase.

Positions are absolute positions in the request's sequence (prompt token 0 is position 0; the first
generated token is fed back at position prompt_len). They are resolved against the prompt, because
the final length is unknown until the request ends:

- `None`: every position.
- an int or a list of ints: those positions; a negative int counts from the end of the prompt
  (-1 is the last prompt token).
- a slice / `{"start": a, "stop": b, "step": s}`: the positions start, start+step, ... below stop;
  negative bounds count from the end of the prompt, a missing stop means "to the end of generation".
- `"last"`: the last prompt position (prompt_len - 1), whose output predicts the first generated token.

Phases:

- `"all"` (default), `"prompt"` (positions < prompt_len), `"generated"` (positions >= prompt_len),
- a list of generation steps: step 0 is the prompt pass (positions < prompt_len) and step k >= 1 is the
  forward at position prompt_len + k - 1 (the one that samples output token k).

A request computes positions 0 .. prompt_len + max_tokens - 2 at most (the last sampled token is never
fed back), so that is the range a selection is resolved in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PHASES = ("all", "prompt", "generated")


@dataclass(frozen=True)
class PositionRange:
    start: int | None = None
    stop: int | None = None
    step: int = 1


@dataclass(frozen=True)
class Selector:
    positions: None | str | tuple[int, ...] | PositionRange = None
    phase: str | tuple[int, ...] = "all"

    @classmethod
    def make(cls, positions: Any = None, phase: Any = "all") -> "Selector":
        """Normalise user input (ints, lists, slices, dicts, "last") or raise ValueError naming the problem."""
        return cls(_normalize_positions(positions), _normalize_phase(phase))

    def resolve(self, prompt_len: int, limit: int) -> np.ndarray:
        """Sorted selected positions (int64) of a request with `prompt_len` prompt tokens that computes
        positions [0, limit)."""
        selected = self._resolve_positions(prompt_len, limit)
        phase = self.phase
        if phase == "prompt":
            selected = selected[selected < prompt_len]
        elif phase == "generated":
            selected = selected[selected >= prompt_len]
        elif isinstance(phase, tuple):
            allowed = np.zeros(limit, dtype=bool)
            for step in phase:
                if step == 0:
                    allowed[:prompt_len] = True
                elif prompt_len + step - 1 < limit:
                    allowed[prompt_len + step - 1] = True
            selected = selected[allowed[selected]]
        return selected

    def _resolve_positions(self, prompt_len: int, limit: int) -> np.ndarray:
        positions = self.positions
        if positions is None:
            return np.arange(limit, dtype=np.int64)
        if positions == "last":
            return np.array([prompt_len - 1], dtype=np.int64)
        if isinstance(positions, PositionRange):
            start = _absolute(positions.start if positions.start is not None else 0, prompt_len, "start")
            stop = limit if positions.stop is None else min(_absolute(positions.stop, prompt_len, "stop"), limit)
            return np.arange(start, max(stop, start), positions.step, dtype=np.int64)
        absolute = sorted({_absolute(p, prompt_len, "position") for p in positions})
        beyond = [p for p in absolute if p >= limit]
        if beyond:
            raise ValueError(f"positions {beyond[:5]} are beyond what this request computes (positions 0..{limit - 1}"
                             f" for a {prompt_len}-token prompt and its max_tokens)")
        return np.array(absolute, dtype=np.int64)

    # ---- JSON -----------------------------------------------------------------------------------
    def positions_json(self) -> Any:
        p = self.positions
        if isinstance(p, PositionRange):
            return {"start": p.start, "stop": p.stop, "step": p.step}
        return list(p) if isinstance(p, tuple) else p

    def phase_json(self) -> Any:
        return list(self.phase) if isinstance(self.phase, tuple) else self.phase

    def describe(self) -> str:
        return f"positions={self.positions_json()!r}, phase={self.phase_json()!r}"


def _absolute(position: int, prompt_len: int, what: str) -> int:
    absolute = position if position >= 0 else prompt_len + position
    if absolute < 0:
        raise ValueError(f"{what} {position} counts back past the start of a {prompt_len}-token prompt")
    return absolute


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _normalize_positions(positions: Any) -> None | str | tuple[int, ...] | PositionRange:
    if positions is None or isinstance(positions, PositionRange):
        return positions
    if isinstance(positions, str):
        if positions != "last":
            raise ValueError(f"positions must be None, an int, a list of ints, a slice or 'last', got {positions!r}")
        return positions
    if _is_int(positions):
        return (int(positions),)
    if isinstance(positions, slice):
        return _make_range(positions.start, positions.stop, positions.step)
    if isinstance(positions, dict):
        unknown = set(positions) - {"start", "stop", "step"}
        if unknown:
            raise ValueError(f"a positions range takes start, stop and step; unknown keys {sorted(unknown)}")
        return _make_range(positions.get("start"), positions.get("stop"), positions.get("step"))
    if isinstance(positions, (list, tuple)):
        if not positions:
            raise ValueError("positions is an empty list (it would select nothing); use None for all positions")
        if not all(_is_int(p) for p in positions):
            raise ValueError(f"positions must be integers, got {list(positions)[:5]!r}")
        return tuple(int(p) for p in positions)
    raise ValueError(f"positions must be None, an int, a list of ints, a slice or 'last', got {positions!r}")


def _make_range(start: Any, stop: Any, step: Any) -> PositionRange:
    for name, value in (("start", start), ("stop", stop), ("step", step)):
        if value is not None and not _is_int(value):
            raise ValueError(f"positions range {name} must be an integer or null, got {value!r}")
    step = 1 if step is None else int(step)
    if step < 1:
        raise ValueError(f"positions range step must be >= 1, got {step}")
    return PositionRange(None if start is None else int(start), None if stop is None else int(stop), step)


def _normalize_phase(phase: Any) -> str | tuple[int, ...]:
    if isinstance(phase, str):
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)} or a list of generation steps, got {phase!r}")
        return phase
    if _is_int(phase):
        phase = [phase]
    if isinstance(phase, (list, tuple)) and phase and all(_is_int(s) and s >= 0 for s in phase):
        return tuple(sorted({int(s) for s in phase}))
    raise ValueError(f"phase must be one of {', '.join(PHASES)} or a non-empty list of generation steps >= 0, "
                     f"got {phase!r}")
