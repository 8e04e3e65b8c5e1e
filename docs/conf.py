"""Sphinx configuration for gradsync's guides and API reference (``sphinx-build -E -W -b html docs docs/_build/html``).

Everything builds offline: no intersphinx, no remote images. The API pages document public import paths only
(``gradsync.comm.DiLoCo``, never the module that defines it), so moving a module inside the library changes
nothing here.
"""

from __future__ import annotations

import importlib.util
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

# The trainers gradsync integrates with are extras of their own, not the docs extra's: where one is not installed (a
# docs host that installs gradsync[docs] alone), autodoc imports our integration against a stand-in, and the page
# still shows our classes and their docstrings. Where it is installed, the real one is used.
autodoc_mock_imports = [name for name in ("lightning", "accelerate") if importlib.util.find_spec(name) is None]

napoleon_google_docstring = True
napoleon_numpy_docstring = False


def _signature_of_own_init(app, what, name, obj, options, signature, return_annotation):  # noqa: ANN001, ANN201
    """A class whose base is a stand-in (above) is shown with its own ``__init__``'s signature, as it is with the
    real trainer installed: autodoc would otherwise read the stand-in's catch-all ``__new__``."""
    from sphinx.util.inspect import signature as signature_of
    from sphinx.util.inspect import stringify_signature

    if what != "class" or not hasattr(obj, "__sphinx_mock__"):  # inherited from the stand-in, if it is one
        return None
    own = signature_of(obj.__init__, bound_method=True, type_aliases=app.config.autodoc_type_aliases)
    return stringify_signature(own, show_return_annotation=False), return_annotation


def setup(app):  # noqa: ANN001, ANN201
    app.connect("autodoc-process-signature", _signature_of_own_init)
