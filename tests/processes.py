"""The test process's children, read from /proc (Linux)."""
from __future__ import annotations

import os


def engine_children() -> set[int]:
    """Pids of this process's live engine-core children (read from /proc: Linux)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                cmdline = handle.read()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"pellucid.engine.core_proc" in cmdline:
            found.add(int(entry))
    return found
