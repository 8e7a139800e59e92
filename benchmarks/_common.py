"""What every benchmark script shares: the versions it ran with, and how it saves results."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def versions(*extra: str) -> dict[str, str]:
    """Python's version and those of the packages a benchmark exercises (and of ``extra`` ones)."""
    found = {"python": platform.python_version()}
    for dist in ("celery", "kombu", "redis", "celery-dedup", *extra):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def save(output: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``output`` (creating its folder) and say where."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print()
    print(f"wrote {output}")
