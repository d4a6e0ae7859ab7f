"""Writes the benchmarks page of the documentation: ``python -m benchmarks._site``.

Reads every committed result, ``benchmarks/results/NAME.json`` (not the
``NAME.quick.json`` smoke runs), and writes ``docs/api/benchmarks.rst``: per
benchmark, its title (the first paragraph of ``benchmarks/NAME.py``'s
docstring), the command that reruns it, its candidate and peer, its tables,
its notes and its plots (``benchmarks/results/NAME*.png``, referenced where
they are). ``tests/test_benchmark_harness.py`` checks that the committed page
is what this writes: rerun it after a benchmark run.

Named with a leading underscore so that ``python -m benchmarks.run`` does not
take it for a benchmark.
"""

import ast
import glob
import json
import os
import re
import sys

from benchmarks import _harness

BENCHMARKS_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = _harness.RESULTS_DIR
REPO = os.path.dirname(BENCHMARKS_DIR)
PAGE = os.path.join(REPO, "docs", "api", "benchmarks.rst")
COMMAND = "python -m benchmarks._site"

INTRO = """\
Each benchmark runs a candidate and its peer in one run (repeats
interleaved, medians reported) and writes ``benchmarks/results/NAME.json``
with the machine, the library versions and the seed;
``python -m benchmarks.run NAME`` runs one again (``--quick`` for a smoke
run, written to ``NAME.quick.json``). The figures below are those of the
committed result files. Most were measured on a shared 2-core machine, where
the chief, the parameter servers and the workers of a cluster share the same
two cores: read the throughput figures as what that machine allows, and the
accuracy figures as the comparison of methods. The user guides say what each
result means for a strategy."""


def results(results_dir=RESULTS_DIR):
    """``[(name, document)]`` of every full-run result file, by name."""
    out = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        name = os.path.basename(path)[: -len(".json")]
        if name.endswith(".quick"):
            continue
        with open(path, encoding="utf-8") as f:
            out.append((name, json.load(f)))
    return out


def title(name, benchmarks_dir=BENCHMARKS_DIR):
    """The first paragraph of ``benchmarks/NAME.py``'s docstring, without its
    ````NAME``:`` prefix; None without a module or docstring."""
    try:
        with open(os.path.join(benchmarks_dir, f"{name}.py"), encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    except (OSError, SyntaxError):
        return None
    if not doc:
        return None
    first = " ".join(doc.split("\n\n", 1)[0].split())
    first = re.sub(rf"^``{re.escape(name)}``:\s*", "", first)
    return first[:1].upper() + first[1:]


def plots(name, names, results_dir=RESULTS_DIR):
    """The PNG files of ``results_dir`` that belong to benchmark ``name``: their
    names start with it, and with no longer benchmark name (``large_batch``'s
    are not ``large_batch_layerwise``'s); a smoke run's (``*.quick.png``) are
    left out, as its results are."""
    out = []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.png"))):
        stem = os.path.basename(path)[: -len(".png")]
        if stem.endswith(".quick"):
            continue
        owners = [n for n in names if stem == n or stem.startswith(n + "_")]
        if owners and max(owners, key=len) == name:
            out.append(path)
    return out


_SPECIAL = re.compile(r"([\\`*_|\[\]<>])")


def text(value):
    """``value`` as inline reStructuredText that reads as written: markup
    characters escaped, except ````literal```` spans, kept as literals."""
    parts = re.split(r"(``[^`]+``)", " ".join(str(value).split()))
    out = "".join(p if p.startswith("``") else _SPECIAL.sub(r"\\\1", p) for p in parts)
    if out.endswith("::"):
        out = out[:-1] + "\\:"
    # A leading list marker or punctuation would start a list or a transition.
    if out and not out[0].isalnum() and not out.startswith(("\\", "``")):
        out = "\\" + out
    elif re.match(r"\w{1,3}[.)](\s|$)", out):
        out = "\\" + out
    return out


def _cell(value):
    shown = _harness._fmt(value)
    bold = re.fullmatch(r"\*\*([^*]+)\*\*", shown)  # a section row of a table
    return f"**{text(bold.group(1))}**" if bold else text(shown)


def list_table(table, caption=""):
    lines = [f".. list-table:: {text(caption)}".rstrip(), "   :header-rows: 1", ""]
    for row in [table["columns"], *table["rows"]]:
        for i, value in enumerate(row):
            cell = _cell(value)
            lines.append(f"   {'*' if i == 0 else ' '} - {cell}".rstrip())
    return lines


def section(name, document, names, page_dir, benchmarks_dir, results_dir):
    heading = f"``{name}``"
    lines = [heading, "-" * len(heading), ""]
    lead = title(name, benchmarks_dir)
    if lead:
        lines += [lead, ""]
    machine = document.get("machine", {})
    where = f"{machine.get('cpu_count', '?')} cores"
    if machine.get("processor"):
        where += f", {text(machine['processor'])}"
    run = f"``{document.get('command', f'python -m benchmarks.run {name}')}``"
    if "seed" in document:
        run += f", seed {document['seed']}"
    if "elapsed_seconds" in document:
        run += f", {document['elapsed_seconds']:.0f} s"
    lines += [f":Run: {run}, on {where}"]
    for key in ("candidate", "peer"):
        if document.get(key):
            lines.append(f":{key.capitalize()}: {text(document[key])}")
    lines.append("")
    tables = [("", document["table"])] if "table" in document else []
    tables += [
        (key[: -len("_table")].replace("_", " ").capitalize(), value)
        for key, value in sorted(document.items())
        if key.endswith("_table") and isinstance(value, dict) and "columns" in value
    ]
    for caption, table in tables:
        lines += [*list_table(table, caption), ""]
    if document.get("notes"):
        lines += ["Notes:", ""]
        lines += [f"* {text(note)}" for note in document["notes"]]
        lines.append("")
    for path in plots(name, names, results_dir):
        relative = os.path.relpath(path, page_dir).replace(os.sep, "/")
        lines += [f".. image:: {relative}", "   :width: 100%", ""]
    return lines


def render(results_dir=RESULTS_DIR, benchmarks_dir=BENCHMARKS_DIR, page_dir=None):
    """The page's text, from the result files; images relative to ``page_dir``
    (default: the page's folder)."""
    page_dir = os.path.dirname(PAGE) if page_dir is None else page_dir
    documents = results(results_dir)
    names = [name for name, _ in documents]
    lines = [
        f".. Generated by ``{COMMAND}`` from benchmarks/results/*.json: do not edit,",
        "   run it again after a benchmark run.",
        "",
        "Benchmarks",
        "==========",
        "",
        INTRO,
        "",
        ".. contents::",
        "   :local:",
        "",
    ]
    for name, document in documents:
        lines += section(name, document, names, page_dir, benchmarks_dir, results_dir)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv=None):
    page = (sys.argv[1:] if argv is None else argv) or [PAGE]
    with open(page[0], "w", encoding="utf-8") as f:
        f.write(render(page_dir=os.path.dirname(os.path.abspath(page[0]))))
    print(f"wrote {os.path.relpath(page[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
