"""`python -m pellucid ...`: the same CLI as the `pellucid` console script (pellucid.cli)."""
import sys

from pellucid.cli import main

sys.exit(main())
