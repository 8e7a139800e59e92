"""A randomized fault-injection checker for celery-dedup, after Jepsen.

A workload (:mod:`chaos.workload`) calls keyed tasks of every mode from
several producer processes against real prefork workers and a real server;
a nemesis (:mod:`chaos.nemesis`) injects faults at random; every process
records what it did (:mod:`chaos.history`); afterwards a checker
(:mod:`chaos.checker`) decides whether the merged history keeps the
library's promises. :mod:`chaos.runner` runs it all: ``python3 run-chaos``.
"""
