"""``python -m benchmarks``: every benchmark, then the chart (see ``benchmarks/run_all.py``)."""

from __future__ import annotations

import sys

from benchmarks.run_all import main

sys.exit(main())
