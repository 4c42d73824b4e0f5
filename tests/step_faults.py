"""Faults injected into a running AsyncLLM's engine steps (slow steps, failing steps), undone on exit.
The engine core must run in the test's process (AsyncLLM(..., engine_process=False))."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from pellucid.engine.async_llm import AsyncLLM

@contextlib.contextmanager
def slowed_steps(llm: AsyncLLM, seconds: float) -> Iterator[None]:
    """Make every engine step take at least `seconds`, so a request is reliably still running later."""
    core = llm.engine
    real_step = core.step

    def slow_step():
        time.sleep(seconds)
        return real_step()

    core.step = slow_step
    try:
        yield
    finally:
        del core.step


@contextlib.contextmanager
def failing_step(llm: AsyncLLM) -> Iterator[Callable[[], None]]:
    """Make the next engine step raise RuntimeError("injected step failure"); the steps after it run normally.
    Yields `fail_next_step()`, which arms one more failure."""
    core = llm.engine
    real_step = core.step
    failures = {"left": 1}

    def step():
        # Only a step with requests to run may consume the failure: the loop also steps to flush the
        # outputs of requests it just failed, and that must not use up a failure armed for the next request.
        if failures["left"] and core.scheduler.has_unfinished_requests():
            failures["left"] -= 1
            raise RuntimeError("injected step failure")
        return real_step()

    def fail_next_step() -> None:
        failures["left"] = 1

    core.step = step
    try:
        yield fail_next_step
    finally:
        del core.step
