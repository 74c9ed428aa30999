import sys

from vmm.bench.cli import main

sys.exit(main())
