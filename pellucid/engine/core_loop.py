"""The engine core's busy loop: take new requests, aborts and utility calls, step, send the outputs.

One loop for an engine in its own process (core_proc.py, fed by a socket-reading thread) and for one
in a thread of the frontend's process (ThreadedClient): only how inputs arrive and where outputs go
differ. The loop sleeps on its input queue only while the engine has nothing to do.
"""
from __future__ import annotations

import queue
import traceback
from typing import Any, Callable

from pellucid.engine.engine_core import EngineCore
from pellucid.engine.messages import (EngineCoreOutputs, EngineCoreRequest, FinishRequests, Shutdown,
                                      UtilityCall, UtilityResult)
from pellucid.logger import get_logger

logger = get_logger(__name__)

_WAKE = object()     # an input that only ends the loop's wait


class EngineCoreLoop:
    """`emit` gets each report in a one-item list and takes it out: the loop keeps no reference to a report
    it has handed over, so the frontend's final outputs become the only owners of what they carry (saves)."""

    def __init__(self, core: EngineCore, inputs: "queue.Queue[Any]",
                 emit: Callable[[list[EngineCoreOutputs]], None]) -> None:
        self.core = core
        self.inputs = inputs
        self.emit = emit
        core.wake = lambda: inputs.put(_WAKE)     # a deferred output became ready: step to report it

    def run(self) -> None:
        """Serve until a Shutdown arrives; then every request in flight is aborted and reported."""
        core = self.core
        while True:
            if not self._apply_inputs(block=not core.has_unfinished_requests()):
                core.abort_all()
                self._step()
                return
            if core.has_unfinished_requests():
                self._step()

    def _apply_inputs(self, block: bool) -> bool:
        """Apply every queued input (waiting for one if `block`); False once a Shutdown came."""
        try:
            item = self.inputs.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(item, Shutdown):
                return False
            if item is not _WAKE:
                self._apply(item)
            try:
                item = self.inputs.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, item: Any) -> None:
        core = self.core
        if isinstance(item, EngineCoreRequest):
            try:
                core.add_request(item)
            except Exception as exc:   # the frontend checked it; whatever is left fails this request only
                if not isinstance(exc, ValueError):
                    logger.exception("adding request %s failed", item.request_id)
                core.refuse(item, f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc))
        elif isinstance(item, FinishRequests):
            core.finish_requests(item.request_ids, item.reason, item.num_output_tokens)
        elif isinstance(item, UtilityCall):
            self.emit([EngineCoreOutputs(utility_results=[self._call(item)], stats=core.stats())])
        else:
            logger.error("the engine loop got an unknown input %r; ignored", type(item).__name__)

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            method = self.core.utility(call.method)
            return UtilityResult(call.call_id, result=method(*call.args))
        except ValueError as exc:
            return UtilityResult(call.call_id, error=str(exc))
        except Exception as exc:
            logger.warning("engine utility %s failed: %s: %s", call.method, type(exc).__name__, exc)
            return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}")

    def _step(self) -> None:
        self.emit([self._stepped()])

    def _stepped(self) -> EngineCoreOutputs:
        core = self.core
        try:
            outputs = core.step()
        except Exception as exc:
            # A fault outside the per-step error handling (scheduler, output building): fail what is in
            # flight, report it, and serve on.
            logger.error("engine step failed; failing the requests in flight and serving on:\n%s",
                         traceback.format_exc())
            outputs = core.fail_in_flight(f"engine step failed: {type(exc).__name__}: {exc}")
        outputs.stats = core.stats()
        return outputs
