"""The one project logger. Everything logs through `pellucid` so messages show up under the server too."""
import logging
import os

_CONFIGURED = False


def get_logger(name: str = "pellucid") -> logging.Logger:
    """Return the `pellucid` logger (or a child of it), configuring a stderr handler once."""
    global _CONFIGURED
    root = logging.getLogger("pellucid")
    if not _CONFIGURED:
        _CONFIGURED = True
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S"))
            root.addHandler(handler)
        root.setLevel(os.environ.get("PELLUCID_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return root if name == "pellucid" else root.getChild(name.removeprefix("pellucid."))
