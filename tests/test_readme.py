"""Every ```python block of README.md and every ``.. code-block:: python`` of
the user guides (docs/api/guides/*.rst) runs as written.

Each block runs in a fresh interpreter with a deadline, with this checkout
importable and a temporary working directory for the files it writes, and
must end by itself with exit code 0 and no gRPC connection errors. A block
that repeats an earlier one word for word runs once.
"""

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
GUIDES = os.path.join(REPO, "docs", "api", "guides")


def python_blocks(text):
    """``(section slug, code)`` for each ```python block, in order."""
    blocks, section = [], "top"
    for match in re.finditer(r"^(#+ [^\n]*)$|^```python\n(.*?)^```$", text, re.M | re.S):
        if match.group(1):
            section = re.sub(r"[^a-z0-9]+", "-", match.group(1).lstrip("#").lower()).strip("-")
        else:
            blocks.append((section, match.group(2)))
    return blocks


def _slug(title):
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def rst_python_blocks(text):
    """``(section slug, code)`` for each ``.. code-block:: python`` of a reST page."""
    blocks, section, lines = [], "top", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        underline = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and re.fullmatch(r"([=~^-])\1+", underline) and len(underline) >= len(line):
            section = _slug(line)
        elif line.strip() == ".. code-block:: python":
            i += 1
            while i < len(lines) and re.match(r"\s+:\w", lines[i]):  # the directive's options
                i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                body.append(lines[i])
                i += 1
            blocks.append((section, textwrap.dedent("\n".join(body)).strip("\n") + "\n"))
            continue
        i += 1
    return blocks


def all_blocks():
    """``(id, code)`` of the README's blocks, then each guide's (``PAGE-SECTION``)."""
    with open(README, encoding="utf-8") as f:
        found = python_blocks(f.read())
    for path in sorted(glob.glob(os.path.join(GUIDES, "*.rst"))):
        page = os.path.basename(path)[: -len(".rst")]
        with open(path, encoding="utf-8") as f:
            found += [(f"{page}-{section}", code) for section, code in rst_python_blocks(f.read())]
    blocks, seen = [], set()
    for name, code in found:
        if code.strip() not in seen:
            seen.add(code.strip())
            blocks.append((name, code))
    return blocks


# The default suite runs the README's blocks; the guides' blocks run in the
# slow lane (tox -e tests-all), each guide's strategy having default tests of
# its own.
with open(README, encoding="utf-8") as _f:
    README_SECTIONS = {section for section, _ in python_blocks(_f.read())}


def _block(section, code):
    marks = [] if section in README_SECTIONS else [pytest.mark.slow]
    return pytest.param(code, id=section, marks=marks)


BLOCKS = all_blocks()


def test_readme_python_blocks_are_found():
    sections = [section for section, _ in BLOCKS]
    assert len(sections) == len(set(sections)) >= 5, sections
    assert README_SECTIONS <= set(sections), README_SECTIONS - set(sections)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("code", [_block(s, c) for s, c in BLOCKS])
def test_readme_block_runs_as_written(code, tmp_path):
    (tmp_path / "block.py").write_text(code)
    try:
        proc = subprocess.run(
            [sys.executable, "block.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=270,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2"),
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the block did not end within 270 s\nstderr:\n{e.stderr}")
    assert proc.returncode == 0, proc.stderr[-6000:]
    refused = [l for l in proc.stderr.splitlines() if "Connection refused" in l]
    assert not refused, f"{len(refused)} gRPC 'Connection refused' lines, e.g. {refused[0]}"
