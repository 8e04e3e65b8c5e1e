"""Sphinx configuration for gradsync's guides and API reference (``sphinx-build -E -W -b html docs docs/_build/html``).

Everything builds offline: no intersphinx, no remote images. The API pages document public import paths only
(``gradsync.comm.DiLoCo``, never the module that defines it), so moving a module inside the library changes
nothing here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, when gradsync is not installed

project = "gradsync"
author = "the gradsync authors"
copyright = "the gradsync authors"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3  # README-style links to a section: page.md#heading

html_theme = "furo"
html_title = "gradsync"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # a subclass's override of torch's or Lightning's method shows only our docstring

napoleon_google_docstring = True
napoleon_numpy_docstring = False
