"""`python -m vmm.bench`: the `vmm-bench` CLI (design note in `vmm.bench.cli`)."""

import sys

from vmm.bench.cli import main

sys.exit(main())
