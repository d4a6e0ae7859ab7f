"""Sphinx configuration of the API reference (built by `tox -e docs`)."""

import os
import re
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

# The conformance table of guides/keras_compatibility.rst is Markdown, written
# between two markers by `python -m tests.programs.conformance table`; it is
# read as a reStructuredText list-table.
_TABLE_START = "<!-- conformance table: python -m tests.programs.conformance table -->"
_TABLE_END = "<!-- end of conformance table -->"


def _inline(text):
    """Markdown inline text as reST: `code` as a literal, markup characters escaped."""
    parts = re.split(r"(`[^`]+`)", text.strip())
    return "".join(
        f"``{p[1:-1]}``" if p.startswith("`") else re.sub(r"([\\*_|\[\]<>])", r"\\\1", p)
        for p in parts
    )


def _markdown_table(markdown):
    rows, notes = [], []
    for line in markdown.strip().splitlines():
        line = line.strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(set(c) <= set("-: ") for c in cells):  # the separator row
                rows.append(cells)
        elif re.match(r"\d+\. ", line):
            number, note = line.split(". ", 1)
            notes.append(f"{number}. {_inline(note)}")
    out = [".. list-table::", "   :header-rows: 1", ""]
    for row in rows:
        out += [f"   {'*' if i == 0 else ' '} - {_inline(c)}".rstrip() for i, c in enumerate(row)]
    return "\n".join([*out, "", *notes])


def _conformance_table(app, docname, source):
    text = source[0]
    if _TABLE_START in text and _TABLE_END in text:
        head, rest = text.split(_TABLE_START, 1)
        table, tail = rest.split(_TABLE_END, 1)
        source[0] = f"{head}\n{_markdown_table(table)}\n\n{tail}"


def setup(app):
    app.connect("source-read", _conformance_table)
