"""Benchmarks for celery-dedup; each module runs as a script (see benchmarks/README.md)."""

from __future__ import annotations
