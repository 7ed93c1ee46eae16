"""``python -m kvserve.bench {serve,throughput,sweep} ...``: the bench CLI on its own."""

import sys

from kvserve.bench.cli import main

sys.exit(main())
