"""Sphinx configuration of the project's one documentation site (MyST Markdown + autodoc)."""

from __future__ import annotations

import os

project = "MoE kernels"
author = "moe-kernels contributors"
copyright = "2026, moe-kernels contributors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "benchmarks/*.md"]
myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "tasklist"]
myst_heading_anchors = 3

# No intersphinx: the site builds without network access.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Importing the packages must not need a GPU, and Triton must not try to compile anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

html_theme = "furo"
html_title = "MoE kernels"
html_static_path: list[str] = []
