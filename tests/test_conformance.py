"""Keras's ``compile``/``fit`` features under every strategy (issue 38).

Each cell runs one feature program of ``tests/programs/conformance.py`` in
plain Keras and under one strategy, in a fresh process, and passes when
``History``'s keys, the batches and examples trained per epoch,
``optimizer.iterations`` and the feature's own observations equal plain
Keras's (values too where the strategy's arithmetic is Keras's), or when the
strategy refused the feature before the first batch with an error naming it.
Every example counts: the programs count how often each example was trained.

The default suite runs :data:`DEFAULT` (the features whose handling differs
between strategies, two to five per strategy); ``pytest -m slow`` runs the
whole matrix. With ``TFDIST_CONFORMANCE_RESULTS=path`` each verdict is also
written to that JSON file, from which ``python -m tests.programs.conformance
table`` writes the README's table.
"""

import json
import os

import pytest

from tests.programs import ProgramError
from tests.programs import run_program
from tests.programs import run_workers
from tests.programs.conformance import FEATURES
from tests.programs.conformance import STRATEGIES
from tests.programs.conformance import judge

DEFAULT = {
    "downpour": [
        "per_output_losses",
        "py_dataset",
        "steps_per_execution",
        "jit_compile",
        "gradient_accumulation",
    ],
    "easgd": ["per_output_losses", "py_dataset", "steps_per_execution"],
    "sandblaster": ["per_output_losses", "jit_compile"],
    "compressed_mirrored": ["per_output_losses", "py_dataset_threads", "steps_per_execution"],
    "model_parallel_1": ["class_weight", "early_stopping", "on_batch"],
    "model_parallel_2": ["per_output_losses", "py_dataset", "steps_per_epoch"],
}

CELLS = [
    pytest.param(
        strategy,
        feature,
        marks=() if feature in DEFAULT.get(strategy, ()) else pytest.mark.slow,
        id=f"{strategy}-{feature}",
    )
    for strategy in STRATEGIES
    for feature in FEATURES
]

_RUNS = {}  # strategy -> the program's result for the features selected


def _selected_features(session, strategy):
    features = []
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.module.__name__.endswith("test_conformance") and params.get("strategy") == strategy:
            features.append(params["feature"])
    return features


def _runs(request, strategy):
    """The strategy's program run once for all its selected cells (a failed
    run fails each of them with its error, without running again)."""
    if strategy not in _RUNS:
        features = _selected_features(request.session, strategy)
        try:
            _RUNS[strategy] = _run(request, strategy, features)
        except ProgramError as e:
            _RUNS[strategy] = e
    if isinstance(_RUNS[strategy], ProgramError):
        raise _RUNS[strategy]
    return _RUNS[strategy]


def _run(request, strategy, features):
    if strategy != "compressed_multiworker":
        return run_program("conformance", strategy, *features, timeout=1200)
    shared = request.getfixturevalue("tmp_path_factory").mktemp("shared")
    workers = run_workers(
        "conformance",
        strategy,
        *features,
        timeout=1200,
        env={"CONFORMANCE_SHARED_DIR": str(shared)},
    )
    return {**run_program("conformance", "keras", *features, timeout=1200), **workers}


def _record(strategy, feature, verdict):
    path = os.environ.get("TFDIST_CONFORMANCE_RESULTS")
    if not path:
        return
    results = {}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    results.setdefault(strategy, {})[feature] = list(verdict)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


@pytest.mark.timeout(1300)
@pytest.mark.parametrize("strategy, feature", CELLS)
def test_feature_works_as_in_keras_or_is_refused_at_fit_start(request, strategy, feature):
    result = _runs(request, strategy)
    verdict = judge(strategy, feature, result["keras"][feature], result[strategy][feature])
    _record(strategy, feature, verdict)
    assert verdict[0] in ("works", "refused"), verdict[1]


def test_readme_and_guide_tables_are_the_ones_the_results_give(tmp_path):
    """The README's summary and the guide's table are written from docs/conformance.json
    (``python -m tests.programs.conformance table``), never by hand."""
    import shutil

    from tests.programs.conformance import write_table

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    page, readme = tmp_path / "page.rst", tmp_path / "README.md"
    shutil.copy(os.path.join(root, "docs/api/guides/keras_compatibility.rst"), page)
    shutil.copy(os.path.join(root, "README.md"), readme)
    write_table(os.path.join(root, "docs/conformance.json"), page, readme)
    with open(os.path.join(root, "docs/api/guides/keras_compatibility.rst")) as f:
        assert page.read_text() == f.read()
    with open(os.path.join(root, "README.md")) as f:
        assert readme.read_text() == f.read()
