"""Sphinx configuration of jamp's docs: guides in Markdown (MyST), an API reference from
the docstrings (autodoc + napoleon, Google style).

Build: ``pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html``.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jamp"
author = "the jamp authors"
copyright = "2026, the jamp authors"  # noqa: A001 (Sphinx's name)
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "examples", "README.md"]
myst_heading_anchors = 3
autosummary_generate = True
autodoc_typehints = "description"
autodoc_member_order = "bysource"
# A package documents what it defines; re-exports are documented where they are defined.
autodoc_default_options = {"members": True, "show-inheritance": True, "ignore-module-all": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple fields: documented once, by the class docstring
html_theme = "furo"
html_title = "jamp"
