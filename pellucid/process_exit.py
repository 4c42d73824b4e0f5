"""How a child process ended, in words (for the errors of engines and workers that die)."""
from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', from a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
