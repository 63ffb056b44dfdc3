"""Sphinx configuration of the project's one documentation site (MyST Markdown + autodoc)."""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

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
# The site is exactly the pages in the navigation: results files and their figures under benchmarks/
# are data, never pages.
exclude_patterns = ["_build", "benchmarks/**"]
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

# The repository's and this site's addresses, kept once in the workspace's pyproject.toml.
with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
    _urls = tomllib.load(f)["tool"]["moe-kernels"]
REPO_URL = _urls["repository"]
DOCS_URL = _urls["documentation"]

html_theme = "furo"
html_baseurl = DOCS_URL + "/"
html_theme_options = {
    "source_repository": REPO_URL,
    "source_branch": "main",
    "source_directory": "docs/",
}
html_title = "MoE kernels"
html_static_path: list[str] = []
