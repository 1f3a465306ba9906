"""`python -m gridgraph ...`: the command line (see gridgraph.cli)."""

import sys

from gridgraph.cli import main

sys.exit(main())
