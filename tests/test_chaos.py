"""The chaos soak (issue 41), short: faults injected into real training jobs,
each survived, with nothing hung or left behind. ``python -m benchmarks.run
chaos`` is the long version."""

import os
import random
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a folder of the repository, not installed

from benchmarks import chaos  # noqa: E402


def test_the_schedule_kills_every_interval_and_stalls_and_kills_the_ps_once():
    events = chaos._schedule(random.Random(3), 300.0, (20.0, 40.0), ("stall", "ps"))
    kills = [t for t, kind in events if kind == "kill"]
    assert [kind for _, kind in events].count("stall") == 1
    assert [kind for _, kind in events].count("ps") == 1
    assert 20.0 <= kills[0] <= 40.0 and kills[-1] < 300.0
    assert all(20.0 <= b - a <= 40.0 for a, b in zip(kills, kills[1:]))
    assert len(kills) >= 300 // 40 - 1
    # The stall comes before the ps kill, both inside the run.
    (stall,) = [t for t, kind in events if kind == "stall"]
    (ps,) = [t for t, kind in events if kind == "ps"]
    assert 0.2 * 300 <= stall <= 0.45 * 300 <= ps <= 0.7 * 300


def _survived_cleanly(report):
    assert report["completed"], report["attempts"]
    assert report["hangs"] == 0
    assert report["leftover_processes"] == [] and report["leftover_files"] == []


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_downpour_survives_killed_workers_a_stall_and_a_killed_ps():
    calm = chaos.soak("downpour", chaos.QUICK, seed=0)
    _survived_cleanly(calm)
    assert calm["faults"] == [] and calm["epochs_redone"] == 0
    # The faults laid over a stretch shorter than the undisturbed run, so
    # that the ps kill lands while the job trains.
    chaotic = chaos.soak("downpour", chaos.QUICK, seed=0, span=0.7 * calm["wall_seconds"])
    _survived_cleanly(chaotic)
    kinds = [f["kind"] for f in chaotic["faults"]]
    assert {"worker killed", "worker stalled", "ps killed"} <= set(kinds), kinds
    # Killed and stalled workers never stop a training chief; the ps kill
    # does, once. A chief started again while a worker is down or stopped
    # refuses to start (it names the task) and the retry loop runs it again.
    assert 1 <= len(chaotic["attempts"]) <= 3, chaotic["attempts"]
    # Every failure is the strategy's own error, naming the lost task.
    assert all(a.startswith("tfdist_ext.cluster._process.Cluster") for a in chaotic["attempts"]), (
        chaotic["attempts"]
    )
    assert all("did not answer" in a for a in chaotic["attempts"][1:]), chaotic["attempts"]
    assert chaotic["epochs_begun"] == chaos.QUICK["downpour"]["epochs"] + chaotic["epochs_redone"]
    assert abs(chaotic["accuracy"] - calm["accuracy"]) <= 0.02


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_synchronous_job_relaunched_after_each_killed_worker_resumes():
    chaotic = chaos.soak("sync", chaos.QUICK, seed=0, span=30.0)
    _survived_cleanly(chaotic)
    assert [f["kind"] for f in chaotic["faults"]] == ["worker killed"] * 2
    # Each kill lands after an epoch's end, so the relaunched job resumes
    # from that backup and redoes at most the epoch the kill cut short.
    assert 1 <= chaotic["epochs_redone"] <= 2
    assert chaotic["accuracy"] >= 0.9
