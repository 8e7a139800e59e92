"""How far in the future a call's countdown or ETA puts its run: its key is held that much longer.

The one place the publisher reads its own clock.
"""

from __future__ import annotations

import datetime
from typing import Any


def delay_seconds(countdown: Any, eta: Any) -> float:
    """How far in the future a countdown or ETA puts the run (the key is held that much longer)."""
    if countdown:
        return max(float(countdown), 0.0)
    if eta is None:
        return 0.0
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    now = datetime.datetime.now(eta.tzinfo or None)
    return max(float((eta - now).total_seconds()), 0.0)
