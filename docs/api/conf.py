"""Sphinx configuration of the API reference (built by `tox -e docs`)."""

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist_ext  # noqa: E402

project = "tfdist_ext"
release = version = tfdist_ext.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]

# Google-style docstrings, as the code writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Base classes and annotations from TensorFlow and Keras have no pages here.
nitpicky = False
exclude_patterns = ["_build"]
html_theme = "alabaster"
autodoc_inherit_docstrings = False  # TensorFlow's are Markdown, not reST
