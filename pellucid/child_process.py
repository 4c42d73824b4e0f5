"""Child processes that never outlive their parent: the engine-core process and tensor-parallel workers.

A child is a fresh interpreter (`python -m MODULE`), not a fork or a multiprocessing spawn: it never
re-imports the parent's main module and starts the same way under a script, a notebook or the server. Its
stdin is a pipe from the parent: the start-up settings come first (pickled), and end-of-file afterwards
means the parent is gone, whatever ended it (SIGKILL included), so the child exits at once.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Any, Callable

import zmq


def start_child(module: str, settings: Any) -> subprocess.Popen:
    """`python -m module` with `settings` pickled to its stdin; it imports the same Pellucid as this process,
    wherever that was imported from."""
    proc = spawn_child(module)
    send_settings(proc, settings)
    return proc


def spawn_child(module: str) -> subprocess.Popen:
    """`python -m module`, its settings not sent yet: it imports its modules meanwhile and then waits on its
    stdin for `send_settings` (or exits, if the pipe closes first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # OpenMP threads that spin while they wait take the cores the child's own threads (sockets, output
    # encoding) and the parent's process need: on a 2-core machine a CPU engine streaming 128 requests
    # ran at 424 output tok/s spinning and 13,557 waiting passively (the same engine in one process:
    # 13,606). A GPU process runs few CPU kernels, so passive waiting costs it nothing.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, env=env)


def send_settings(proc: subprocess.Popen, settings: Any) -> None:
    assert proc.stdin is not None
    pickle.dump(settings, proc.stdin)
    proc.stdin.flush()


def read_settings(pipe: Any) -> Any:
    """In the child: the settings its parent sent, or None when the parent closed the pipe without sending
    any (it gave the child up before its turn came)."""
    try:
        return pickle.load(pipe)
    except EOFError:
        return None


_ABRUPT_EXIT_HOOKS: list[Callable[[], None]] = []


def on_abrupt_exit(hook: Callable[[], None]) -> Callable[[], None]:
    """Run `hook` when this process leaves at once (exit_now, or its parent gone), which skips atexit: for
    what does not end with the process by itself (a local Ray cluster's agents). Returns the undo."""
    _ABRUPT_EXIT_HOOKS.append(hook)
    return lambda: _ABRUPT_EXIT_HOOKS.remove(hook) if hook in _ABRUPT_EXIT_HOOKS else None


def _run_abrupt_exit_hooks() -> None:
    for hook in list(_ABRUPT_EXIT_HOOKS):
        try:
            hook()
        except Exception as exc:        # leaving anyway: say so and go on
            print(f"pellucid: a clean-up at exit failed: {type(exc).__name__}: {exc}", file=sys.stderr)


def exit_when_parent_is_gone(pipe: Any, on_gone: Callable[[], None]) -> None:
    """In the child: once its stdin (`pipe`, after the settings) reaches end-of-file, call `on_gone` (to
    log it) and end the process at once."""
    def watch() -> None:
        try:
            while pipe.read(4096):
                pass
        except OSError:
            pass
        on_gone()
        _run_abrupt_exit_hooks()
        os._exit(1)
    threading.Thread(target=watch, name="pellucid-parent-watch", daemon=True).start()


def exit_now(context: zmq.Context, sockets: list[zmq.Socket], code: int, linger_ms: int) -> None:
    """Deliver what is still queued on `sockets` (up to `linger_ms`), then leave at once: no interpreter
    teardown, in which the thread still blocked on stdin (or a collective) would make the exit fail."""
    for sock in sockets:
        sock.close(linger=linger_ms)
    context.term()
    _run_abrupt_exit_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def describe_exit(code: int) -> str:
    """'was killed by SIGKILL' or 'exited with code 1', from a Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
