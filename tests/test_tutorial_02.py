"""Tutorial 2 runs as a new user would run it."""

import pytest


# Under tests-all with tutorials 1, 3, 4 and 6 and the README's Sandblaster
# block (45 s here): tests/test_sandblaster.py (the same fit against SciPy,
# backups, stragglers, a killed worker, save and load) keeps that API in the
# default suite.
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tutorial_02_sandblaster_runs(tutorial):
    out = tutorial("02_sandblaster_lbfgs.py", "--quick", timeout=280)
    assert "Sandblaster L-BFGS (2 workers, 2 ps): loss" in out
    assert "minimize, worker 1 slowed 4x" in out
    assert "Saved and reloaded outside the cluster" in out
    slowed = float(out.split("slowed 4x: loss ")[1].split()[0])
    plain = float(out.split("(unslowed ")[1].split(")")[0])
    assert abs(slowed - plain) <= 1e-5 * plain
    held_out = float(out.split("held-out accuracy ")[-1].split()[0])
    assert held_out > 0.9
    verdict = out.rstrip().splitlines()[-1]
    assert verdict.startswith("VERDICT: Sandblaster L-BFGS matches SciPy's L-BFGS-B"), verdict
    assert "needs the full run (this quick run stops after 30 iterations" in verdict
