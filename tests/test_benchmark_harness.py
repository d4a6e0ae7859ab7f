"""The benchmark harness: interleaving, figures, tables, result files."""

import json
import os
import subprocess
import sys
import types

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a folder of the repository, not installed

from benchmarks import _harness  # noqa: E402


def test_interleaved_rotates_order_and_discards_warmup():
    calls = []

    def system(name):
        def run():
            calls.append(name)
            return len(calls)

        return run

    samples = _harness.interleaved({"a": system("a"), "b": system("b")}, repeats=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert samples == {"a": [3.0, 6.0, 7.0], "b": [4.0, 5.0, 8.0]}


def test_figure_and_table():
    fig = _harness.figure("mlp", "keras", "throughput", "examples/s", [3.0, 1.0, 2.0], steps=5)
    assert fig["median"] == 2.0 and fig["unit"] == "examples/s" and fig["steps"] == 5
    text = _harness.format_table({"columns": ["a", "b"], "rows": [["x", 1234.5678], ["y", 0.5]]})
    lines = text.splitlines()
    assert lines[0].startswith("| a") and "1,234.6" in text and "0.5" in text
    assert len(lines) == 4


def test_write_result_has_machine_versions_and_seed(tmp_path, monkeypatch):
    monkeypatch.setattr(_harness, "RESULTS_DIR", str(tmp_path))
    path = _harness.write_result(
        "demo",
        {"candidate": "c", "peer": "p", "figures": [], "table": {"columns": [], "rows": []}},
        quick=True,
        seed=3,
        elapsed=1.0,
    )
    doc = json.load(open(path))
    assert path.endswith("demo.quick.json")
    assert doc["seed"] == 3 and doc["peer"] == "p" and doc["machine"]["cpu_count"] >= 1
    assert "tensorflow" in doc["versions"] and "keras" in doc["versions"]


def test_committed_scaling_result_is_from_a_real_run():
    doc = json.load(open(os.path.join(REPO, "benchmarks", "results", "scaling.json")))
    assert doc["quick"] is False and doc["peer"] and doc["candidate"]
    systems = {(f["case"], f["system"]) for f in doc["figures"]}
    assert systems == {
        ("mlp", "keras"),
        ("mlp", "mirrored-2"),
        ("cnn", "keras"),
        ("cnn", "mirrored-2"),
    }
    assert all(
        f["unit"] == "examples/s" and f["median"] > 0 and len(f["repeats"]) >= 3
        for f in doc["figures"]
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaling_benchmark_quick_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "scaling", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mirrored / keras" in proc.stdout
    doc = json.load(open(os.path.join(REPO, "benchmarks", "results", "scaling.quick.json")))
    assert len(doc["figures"]) == 4


def test_unknown_benchmark_is_rejected():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "nosuch"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_run_in_process_sets_and_unsets_variables(monkeypatch):
    # The allocator benchmark runs each variant with its own environment:
    # a value sets a variable over this process's, None removes it.
    seen = {}

    def fake_run(args, **kwargs):
        seen.update(kwargs["env"])
        return subprocess.CompletedProcess(args, 0, stdout='RESULT {"ok": 1}\n', stderr="")

    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = _harness.run_in_process(
        "benchmarks.nothing", {}, env={"MALLOC_MMAP_MAX_": None, "TF_CPU_ALLOCATOR_USE_BFC": "x"}
    )
    assert out == {"ok": 1}
    assert "MALLOC_MMAP_MAX_" not in seen and seen["TF_CPU_ALLOCATOR_USE_BFC"] == "x"
    assert seen["TF_CPP_MIN_LOG_LEVEL"] == "2"


def test_readme_table_is_written_from_the_results_json_between_its_markers(tmp_path):
    document = {
        "date": "2026-11-28T00:00:00Z",
        "seed": 3,
        "elapsed_seconds": 12.0,
        "command": "python -m benchmarks.run demo",
        "table": {"columns": ["row", "ratio"], "rows": [["a", 1.25]]},
    }
    (tmp_path / "demo.json").write_text(json.dumps(document))
    begin, end = _harness.readme_markers("demo")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{begin}\nstale table\n{end}\nrest\n")
    for _ in range(2):  # idempotent
        assert _harness.update_readme("demo", str(readme), str(tmp_path))
    text = readme.read_text()
    assert text.startswith(f"intro\n{begin}\n| row | ratio |") and text.endswith(f"{end}\nrest\n")
    assert "| a   | 1.25  |" in text and "stale" not in text
    assert "seed 3" in text and "`python -m benchmarks.run demo`" in text
    readme.write_text("no markers\n")
    assert not _harness.update_readme("demo", str(readme), str(tmp_path))


def test_committed_peers_table_in_the_readme_is_the_json_s():
    with open(os.path.join(_harness.RESULTS_DIR, "peers.json")) as f:
        table = _harness.format_table(_harness._readme_columns("peers", json.load(f)["table"]))
    with open(_harness.README) as f:
        assert table in f.read()
    # README_LEAVES_OUT: the settings the "best of each" rows stand for.
    assert "spe 50" not in table and "background fetch" not in table
    assert "best of each" in table


def test_committed_benchmarks_page_is_what_the_site_script_writes():
    from benchmarks import _site

    with open(_site.PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert committed == _site.render(), "stale docs/api/benchmarks.rst: python -m benchmarks._site"


def test_benchmarks_page_lists_each_result_with_its_table_notes_and_plots(tmp_path):
    from benchmarks import _site

    document = {
        "command": "python -m benchmarks.run demo",
        "seed": 0,
        "candidate": "the *candidate*",
        "peer": "the_peer",
        "table": {"columns": ["row", "ratio"], "rows": [["-", 1.25], ["**part**", ""]]},
        "extra_table": {"columns": ["a"], "rows": [[1]]},
        "notes": ["a note with ``code`` and a | bar"],
    }
    (tmp_path / "demo.json").write_text(json.dumps(document))
    (tmp_path / "demo.quick.json").write_text(json.dumps(document))
    (tmp_path / "demo_more.json").write_text(json.dumps(document))
    for png in ("demo_plot.png", "demo_plot.quick.png", "demo_more.png", "other.png"):
        (tmp_path / png).write_bytes(b"")
    text = _site.render(tmp_path, tmp_path, tmp_path)
    assert text.startswith(".. Generated by ``python -m benchmarks._site``")
    assert text.count("``demo``\n--------") == 1 and "``demo_more``" in text
    assert ":Candidate: the \\*candidate\\*" in text and ":Peer: the\\_peer" in text
    assert "* - \\-\n     - 1.25" in text and "* - **part**\n     -\n" in text
    assert ".. list-table:: Extra" in text
    assert "* a note with ``code`` and a \\| bar" in text
    demo = text.split("``demo_more``")[0]
    assert ".. image:: demo_plot.png" in demo and "demo_more.png" not in demo
    assert "other.png" not in text and "quick.png" not in text


def test_peers_time_to_the_same_accuracy():
    from benchmarks import peers

    curve = [(0.0, 0.1), (2.0, 0.5), (4.0, 0.9), (6.0, 0.8)]
    assert peers.time_to(curve, 0.1) == 0.0
    assert peers.time_to(curve, 0.3) == pytest.approx(1.0)
    assert peers.time_to(curve, 0.9) == pytest.approx(4.0)
    assert peers.time_to(curve, 0.95) is None
    # The target is the highest accuracy every run of both sides reached (0.7
    # here): the candidate gets there in 1.5 s, the peer's runs in 4 and 5.5 s.
    cand = [{"curve": [(0.0, 0.1), (1.0, 0.5), (2.0, 0.9)]}]
    peer = [
        {"curve": [(0.0, 0.1), (2.0, 0.4), (4.0, 0.7)]},
        {"curve": [(0.0, 0.1), (4.0, 0.4), (6.0, 0.8)]},
    ]
    target, cand_s, peer_s = peers._to_same_accuracy(cand, peer)
    assert target == 0.7
    assert cand_s == pytest.approx(1.5)
    assert peer_s == pytest.approx((4.0 + 5.5) / 2)


def test_peers_where_the_time_goes():
    """Cores busy = CPU ms per 64-example batch x batches per second / 1000, per
    kind of process; a synchronous run has workers only; idle is 2 - busy."""
    from benchmarks import peers

    runs = {
        "downpour-n1": [
            {
                "examples_per_second": 6400.0,
                "cpu_ms_per_batch": {"chief": 1, "ps": 5, "worker": 10},
            },
            {"examples_per_second": 3200.0, "cpu_ms_per_batch": {"chief": 2, "ps": 4, "worker": 6}},
        ],
        "cmwms-dense": [
            {
                "examples_per_second": 640.0,
                "cpu_ms_per_batch": {"worker": 150},
                "link_mb_per_batch": 2.5,
            }
        ],
    }
    rows = peers._time_rows("digits", "loopback", runs)
    assert rows[0][:3] == ["digits", "loopback", "downpour-n1"]
    # Medians of the two repeats: chief (0.1, 0.1), ps (0.5, 0.2), workers (1.0, 0.3).
    # The link's megabytes are known only on rate-limited links (namespaces).
    assert rows[0][3:-1] == pytest.approx([4800.0, 0.1, 0.35, 0.65, 1.1, 0.9])
    assert rows[0][-1] is None
    assert rows[1][3:] == pytest.approx([640.0, 0.0, 0.0, 1.5, 1.5, 0.5, 2.5])


def test_peers_link_bytes_count_both_ways_on_every_interface_but_loopback():
    from benchmarks import _peers_run

    header = (
        "Inter-|   Receive                |  Transmit\n"
        " face |bytes    packets errs drop|bytes    packets errs drop\n"
    )
    lo = "    lo: 900 9 0 0 0 0 0 0 900 9 0 0 0 0 0 0\n"
    eth = "  eth0: 1000 10 0 0 0 0 0 0 250 5 0 0 0 0 0 0\n"
    assert _peers_run.interface_bytes(header + lo + eth) == 1250
    assert _peers_run.interface_bytes(header + lo) is None  # 127.0.0.1: not measured


@pytest.mark.parametrize("system", ["downpour", "easgd", "pss"])
def test_peers_inputs_run_without_tf_data_autotuning(system):
    # Deleting an autotuned iterator at fit's end can stall for seconds
    # under CPU contention; every system's input is measured without it.
    import numpy as np
    import tensorflow as tf

    from benchmarks import _peers_run

    keras = types.SimpleNamespace(
        utils=types.SimpleNamespace(experimental=types.SimpleNamespace(DatasetCreator=lambda f: f))
    )
    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int64")
    ds = _peers_run._async_input(tf, keras, {"system": system, "seed": 0}, x, y)
    if callable(ds):  # the peer's per-worker dataset_fn
        ds = ds(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0))
    assert ds.options().autotune.enabled is False


def test_peers_synchronous_input_runs_without_autotuning_and_keeps_data_sharding():
    import numpy as np
    import tensorflow as tf

    from benchmarks import _peers_run

    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int64")
    sync = _peers_run.without_autotune(tf, _harness.sharded_batches(tf, x, y, 4, 0))
    policy = sync.options().experimental_distribute.auto_shard_policy
    assert sync.options().autotune.enabled is False
    assert policy == tf.data.experimental.AutoShardPolicy.DATA


def test_peers_plot_draws_the_committed_table(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import peers

    with open(os.path.join(_harness.RESULTS_DIR, "peers.json")) as f:
        document = json.load(f)
    labels, (examples, to_acc) = peers.plotted(document)
    rows = [r for r in document["table"]["rows"] if r[2] != "async, best of each"]
    assert len(labels) == len(rows) == len(examples) == len(to_acc) > 0
    assert labels[0] == f"{rows[0][0]}, {rows[0][1]}: {rows[0][2]}"
    columns = document["table"]["columns"]
    assert examples == [r[columns.index("cand/peer")] for r in rows]
    assert to_acc == [r[columns.index("to acc")] for r in rows]
    (tmp_path / "peers.json").write_text(json.dumps(document))
    path = _harness.write_plot("peers", str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert _harness.write_plot("allocator", str(tmp_path)) is None  # it has no plot


def _run_result(eps, acc, seconds=1.0):
    """One peers run's result: ``acc`` held out ``seconds`` after the first fit."""
    return {
        "examples_per_second": eps,
        "accuracy": acc,
        "cpu_ms_per_batch": {"chief": 1.0},
        "examples_trained": 6400,
        "curve": [(0.0, 0.1), (seconds, acc)],
    }


def test_peers_knob_rows_face_the_peers_fastest_parameter_server_run():
    from benchmarks import peers

    runs = {  # the synthetic 100 Mbit/s case: no steps_per_execution=50 runs
        "downpour-n1": [_run_result(100.0, 0.3)],
        "easgd-tau10": [_run_result(900.0, 0.5)],
        "tf_keras-pss": [_run_result(300.0, 0.4)],
    }
    rows = {r[2]: r for r in peers._rows("synthetic", "100mbit", runs)}
    assert set(rows) == {"async, default", "async, EASGD tau=10", "async, best of each"}
    assert rows["async, EASGD tau=10"][3:5] == ["easgd-tau10", "tf_keras-pss"]
    assert rows["async, EASGD tau=10"][7] == pytest.approx(3.0)
    runs["tf_keras-pss-spe50"] = [_run_result(600.0, 0.4, seconds=2.0)]
    rows = {r[2]: r for r in peers._rows("synthetic", "100mbit", runs)}
    assert rows["async, EASGD tau=10"][4] == "tf_keras-pss-spe50"


def test_peers_best_of_each_is_each_sides_fastest_to_the_same_accuracy():
    from benchmarks import peers

    runs = {
        # More examples/s, less accuracy: slower to the 0.3 both reach.
        "downpour-n1": [_run_result(200.0, 0.3, 1.0)],
        "downpour-n1-background": [_run_result(150.0, 0.5, 1.0)],
        "tf_keras-pss": [_run_result(100.0, 0.4, 2.0)],
        "tf_keras-pss-spe50": [_run_result(90.0, 0.4, 1.5)],
    }
    rows = {r[2]: r for r in peers._rows("synthetic", "100mbit", runs)}
    best = rows["async, best of each"]
    assert best[3:5] == ["downpour-n1-background", "tf_keras-pss-spe50"]
    assert best[7] == pytest.approx(150.0 / 90.0)


def test_push_period_table_takes_medians_over_seeds_and_counts_updates():
    from benchmarks import push_period

    results = {
        "downpour w=2 k=5": {
            "cfg": {"system": "downpour", "workers": 2, "k": 5, "steps": 300},
            "runs": [
                {"accuracy": [0.5, 0.6, 0.7], "staleness_mean": 1.0},
                {"accuracy": [0.7, 0.8, 0.9], "staleness_mean": 2.0},
                {"accuracy": [0.6, 0.7, 0.8], "staleness_mean": 1.5},
            ],
        },
        "keras k=1 d=2": {
            "cfg": {"system": "delayed", "k": 1, "delay": 2, "steps": 300},
            "runs": [{"accuracy": [0.9, 0.95, 0.97]}],
        },
    }
    rows = push_period.table(results)["rows"]
    assert rows[0] == ["downpour w=2 k=5", 5, 60, 1.5, 0.6, 0.7, 0.8]
    assert rows[1] == ["keras k=1 d=2", 1, 300, 2, 0.9, 0.95, 0.97]
