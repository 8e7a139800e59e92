"""A Prometheus collector for celery-dedup's decision counters (the ``prometheus`` extra).

Register it in the process that serves your metrics::

    from prometheus_client import REGISTRY
    from celery_dedup.contrib.prometheus import DedupCollector

    REGISTRY.register(DedupCollector(app))

Each scrape reads the counters from Redis (one ``HGETALL``), so every
process of the app is counted, whichever process serves the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from celery_dedup import runtime

logger = logging.getLogger("celery_dedup")


class DedupCollector(Collector):
    """Exposes ``celery_dedup_decisions_total{task, decision}`` and ``celery_dedup_up``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        up = GaugeMetricFamily("celery_dedup_up", "1 if the dedup store answered this scrape")
        try:
            counts = runtime.stats(self.app)
        except redis.RedisError as exc:
            logger.warning("metrics: the dedup store did not answer: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        decisions = CounterMetricFamily(
            "celery_dedup_decisions",
            "Decisions celery-dedup made, by task and kind (accepted, deduplicated, mismatched, collapsed, "
            "skipped, deferred, limited, lock_lost, released, reaped, fail_open)",
            labels=["task", "decision"],
        )
        waited = CounterMetricFamily(
            "celery_dedup_limit_waited_seconds",
            "Time runs waited for their group's limits (limit_concurrency, limit_rate), by task",
            labels=["task"],
        )
        for task, by_decision in sorted(counts.items()):
            for decision, value in sorted(by_decision.items()):
                if decision == "waited_ms":
                    waited.add_metric([task], value / 1000)
                else:
                    decisions.add_metric([task, decision], value)
        yield decisions
        yield waited
