"""What the `pellucid` logger says during a test, whatever pytest's capture does."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def pellucid_log_records() -> Iterator[list[logging.LogRecord]]:
    """The records the `pellucid` logger emits inside the block (whatever pytest's capture does)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append       # type: ignore[method-assign]
    logger = logging.getLogger("pellucid")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
