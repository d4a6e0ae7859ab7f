"""Tutorial 6 runs as a new user would run it."""

import pytest

SYSTEMS = (
    "Downpour",
    "+ StalenessAwareLR",
    "+ DelayCompensation",
    "SSP max_staleness=2",
    "EASGD tau=8",
)


# The longest default test on a 2-core machine (70 s): run by `tox -e tests-all`;
# the README's "stale gradients and elastic averaging" block covers the same API.
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_tutorial_06_staleness_and_elastic_averaging_runs(tutorial):
    r = tutorial("06_staleness_and_elastic_averaging.py", "--quick", timeout=400)
    runs = r["runs"]
    assert list(runs) == list(SYSTEMS), r
    for name, run in runs.items():
        assert 0.0 < run["accuracy"] <= 1.0, (name, run)
        # Both workers trained in every run, the throttled one included, and
        # every step was run once, by one of them.
        per_worker = run["steps_per_worker"]
        assert set(per_worker) == {"0", "1"} and min(per_worker.values()) > 0, (name, run)
        assert sum(per_worker.values()) == r["steps_per_run"], (name, run)
        assert 0 <= run["staleness_mean"] <= run["staleness_max"], (name, run)
    # The EASGD centre, saved and reloaded without a cluster, is the same model
    # (1e-3 is under one of the 450 test digits).
    assert abs(runs["EASGD tau=8"]["accuracy"] - r["easgd_reloaded_accuracy"]) < 1e-3, r
    # Plain Downpour's pushes are stale: a replica fetches every 8 steps and
    # pushes every step; the histogram counts every push.
    downpour = runs["Downpour"]
    assert downpour["pushes"] > 0 and downpour["staleness_max"] >= 1, downpour
    assert sum(r["downpour_staleness_histogram"]) == downpour["pushes"], r
    # The verdict names the correction with the best accuracy and compares it
    # with plain Downpour's.
    corrections = {name: run["accuracy"] for name, run in runs.items() if name != "Downpour"}
    assert r["best_correction"] == max(corrections, key=corrections.get), r
    assert r["best_accuracy"] == corrections[r["best_correction"]], r
    assert r["downpour_accuracy"] == downpour["accuracy"], r
    assert r["points_over_downpour"] == pytest.approx(
        100 * (r["best_accuracy"] - downpour["accuracy"])
    ), r
    assert r["downpour_mean_staleness"] == pytest.approx(downpour["staleness_mean"]), r
