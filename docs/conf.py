"""Sphinx configuration: the furo theme, Markdown pages (MyST) and autodoc over the package.

Build with ``tox -e docs`` (``sphinx-build -W --keep-going -b html docs docs/_build/html``).
Nothing here needs the network: no intersphinx, no Mermaid.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import celery_dedup  # noqa: E402 - importable only once the repository root is on sys.path

project = "celery-dedup"
author = "celery-dedup contributors"
copyright = "celery-dedup contributors"
version = release = celery_dedup.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = f"celery-dedup {release}"
html_static_path = ["_static"]

# Attribute comments (``#: text``) are prose here, but napoleon reads a colon in
# their first line as "type: description". They skip napoleon: kept before it
# runs (priority 400 < its 500), put back after (600).
_ATTRIBUTE_DOCS: dict[str, list[str]] = {}


def _keep_attribute_doc(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if what in ("attribute", "data"):
        _ATTRIBUTE_DOCS[name] = list(lines)


def _restore_attribute_doc(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    if name in _ATTRIBUTE_DOCS and what in ("attribute", "data"):
        lines[:] = _ATTRIBUTE_DOCS.pop(name)


def setup(app: Any) -> None:
    app.connect("autodoc-process-docstring", _keep_attribute_doc, priority=400)
    app.connect("autodoc-process-docstring", _restore_attribute_doc, priority=600)
