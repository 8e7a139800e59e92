"""Limit groups for user code (public API): the running delivery's grant and every group's state.

The limits themselves run in the worker (:mod:`celery_dedup.worker.limits`)
and their state lives in the store (:mod:`celery_dedup.store.limits`); this
module is what a task body, a script or a view imports.
"""

from __future__ import annotations

from .holding import Holding, acquire
from .policy import LimitPolicy, Rate, parse_rate
from .store.limits import Grant, GroupState, groups
from .worker.limits import current

__all__ = ["Grant", "GroupState", "Holding", "LimitPolicy", "Rate", "acquire", "current", "groups", "parse_rate"]
