"""``python -m chaos``: the same as ``run-chaos``."""

from __future__ import annotations

import sys

from .runner import main

sys.exit(main())
