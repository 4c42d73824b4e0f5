import sys

from pellucid.bench import main

sys.exit(main())
