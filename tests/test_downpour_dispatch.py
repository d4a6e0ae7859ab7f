"""How many steps one Downpour dispatch runs, and what a push sends (issue 13).

A round (one ``ClusterCoordinator`` dispatch) runs many local steps, as
Keras's ``steps_per_execution`` does: the batches Keras's own iterator gives
the chief, ``steps_per_execution`` of them when set, at most about 50
otherwise (fewer, shared, when workers idle), a multiple of ``lcm(n_fetch,
n_push)`` except an epoch's first and last. Fetch, push and step counts stay
those of ``n_fetch``/``n_push``. Each test runs a case of
``tests/programs/downpour_dispatch_cases.py`` in a fresh interpreter.
"""

import pytest

from tests.programs import run_program


@pytest.mark.timeout(300)
def test_one_dispatch_runs_many_steps_with_n_fetch_n_push_kept():
    r = run_program("downpour_dispatch_cases", "many_steps_per_dispatch", timeout=280)
    for name, n, spe, round_size in (
        ("default-n1", 1, 1, 50),
        ("default-n3", 3, 1, 51),
        ("spe10-n1", 1, 10, 10),
        ("spe4-n3", 3, 4, 6),
    ):
        run = r[name]
        # Every step is scheduled exactly once, in rounds of at most round_size.
        assert sum(run["sizes"]) == 240 == run["steps"] == run["iterations"], name
        assert max(run["sizes"]) == round_size, (name, run["sizes"])
        # How many rounds depends on when workers idle; their shape does not:
        # no round spans two epochs, and inside an epoch every round but its
        # first and last is a multiple of lcm(n_fetch, n_push) = n.
        for epoch in _epochs(run["sizes"], 120):
            assert all(size % n == 0 for size in epoch[1:-1]), (name, run["sizes"])
        # Keras's callbacks see every call, as with steps_per_execution in Keras.
        assert run["batches"] == 240 // spe, name
        # n_fetch and n_push hold inside the rounds: a round pushes every n
        # steps and at its end. It fetches at the end of each whole fetch
        # block, its last included (the next round's parameters), and at its
        # start only when its worker holds no such parameters (its first
        # round in this fit, or one after a round that ended inside a block).
        assert run["pushes"] == sum(-(-size // n) for size in run["sizes"]), name
        fresh = 1 + sum(size % n != 0 for size in run["sizes"][:-1])
        assert run["prefetched"] == len(run["sizes"]) - fresh, (name, run)
        assert run["fetches"] == sum(size // n for size in run["sizes"]) + fresh, name
        assert run["loss"][1] < run["loss"][0], name


def _epochs(sizes, steps_per_epoch):
    """Splits round sizes into epochs; fails if a round spans two."""
    epochs, current = [], []
    for size in sizes:
        current.append(size)
        if sum(current) >= steps_per_epoch:
            assert sum(current) == steps_per_epoch, sizes
            epochs.append(current)
            current = []
    assert not current, sizes
    return epochs


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_short_epochs_give_every_worker_rounds_pushes_batched_metrics_exact():
    r = run_program("downpour_dispatch_cases", "short_epochs", timeout=280)
    # An epoch of 40 steps on 2 workers: a worker that idles gets the steps
    # buffered so far, so both workers train.
    assert sum(r["sizes"]) == 120, r["sizes"]
    assert set(r["per_worker"]) == {"0", "1"}, r["per_worker"]
    assert r["pushes"] == sum(-(-size // 2) for size in r["sizes"]), r
    assert r["loss"][-1] < r["loss"][0]
    # The workers' metric updates all arrive (each round adds its local
    # totals at once): the loss is averaged over exactly the epoch's examples.
    assert r["metric_counts"] == {"loss": 40 * 32}, r["metric_counts"]
    # The gradients of the ps task's 4 variables cross as one tensor, split on
    # the ps; the parameters cross back as one tensor, split on the worker.
    (ps,) = set(r["ps"])
    assert set(r["splits"]) == {ps, ""}, r["splits"]
    # With steps_per_execution = 10: a call's 10 batches are shared by the
    # idle workers in rounds of whole blocks (at most 10), so both train;
    # the chief waits for an epoch's first round, so the callbacks' first
    # logs are a trained batch's loss, not the reset metric's 0; every step
    # ran exactly once.
    for epoch in _epochs(r["spe_sizes"], 40):
        assert max(epoch) <= 10 and all(size % 2 == 0 for size in epoch[1:-1]), r["spe_sizes"]
    assert set(r["spe_per_worker"]) == {"0", "1"}, r["spe_per_worker"]
    assert len(r["first_batch_losses"]) == 2 and min(r["first_batch_losses"]) > 0, r
    assert r["spe_steps"] == r["spe_iterations"] == 80, r


@pytest.mark.timeout(300)
def test_overlapped_push_and_fetch_lose_no_update_and_count_staleness():
    # A block's push is applied while the next block computes, and the
    # parameters of the next fetch point are read after that push. The loss
    # is the mean output, so every step's bias gradient is exactly 1: the
    # bias ends at -lr * steps only if every step's gradient is applied once.
    r = run_program("downpour_dispatch_cases", "overlapped_push_and_fetch", timeout=280)
    for name, run in r.items():
        n_fetch, n_push = map(int, name.split(","))
        assert abs(run["bias"] + 0.01 * 100) < 1e-4, (name, run["bias"])
        assert run["iterations"] == 100 == sum(run["sizes"]), name
        assert (
            run["pushes"]
            == len(run["staleness"])
            == sum(-(-size // n_push) for size in run["sizes"])
        ), name
        # A round fetches at the end of each whole fetch block, its last
        # included (kept for the worker's next round, which then fetches
        # nothing before its first step), and at its start when it has no
        # such parameters: its worker's first round in this fit, or one
        # after a round that ended inside a fetch block.
        fresh = 1 + sum(size % n_fetch != 0 for size in run["sizes"][:-1])
        assert run["prefetched"] == len(run["sizes"]) - fresh, (name, run)
        assert run["fetches"] == sum(size // n_fetch for size in run["sizes"]) + fresh, name
    # One worker, n = 1: only the fit's first push is fresh; every later one
    # was computed without the replica's own previous push (a round's first
    # from parameters prefetched before its previous round's last push).
    staleness, sizes = r["1,1"]["staleness"], r["1,1"]["sizes"]
    assert staleness.count(0) == 1 and set(staleness) == {0, 1}, (sizes, staleness)
    assert max(r["2,3"]["staleness"] + r["4,2"]["staleness"]) <= 2, r


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_rounds_start_from_prefetched_parameters_until_weights_are_set():
    # One worker, 2 ps tasks with the hidden kernel split across them. A
    # round's last block fetches the next round's parameters; the worker's
    # next round starts from them, in the same epoch, the next epoch and a
    # fit right after (weights as the last epoch left them), but not after
    # set_weights between fits or in a callback at an epoch's start: that
    # epoch's first round fetches what was set. The loss is the mean
    # output, so the bias's gradient is exactly 1 whatever the staleness:
    # the bias ends at (what was set) - lr * steps only if every step's
    # gradient is applied exactly once.
    r = run_program("downpour_dispatch_cases", "prefetched_until_weights_are_set", timeout=280)
    assert r["split"]
    for run in r["out"]:
        # 6 rounds of 20 steps; every step's push applied once (the callback
        # run: the 60 steps after the weights were set).
        steps = 60 if run["what"] == "callback" else 120
        assert abs(run["bias"] - (run["bias_before"] - 0.01 * steps)) < 1e-4, run
        # Fetches: one per step, each round's last for the next round, and
        # one at the start of a round that holds no prefetched parameters.
        assert run["rounds"] == 6, run
        assert run["fetches"] == 120 + 6 - run["prefetched"], run
    # The first fit, and one after set_weights, fetch at their first round
    # (its first push is fresh); a fit after a fit does not (its first push
    # misses the last fit's last push); weights set at the second epoch's
    # start make that epoch's first round fetch.
    for run, prefetched in zip(r["out"], (5, 6, 5, 6, 5)):
        assert run["prefetched"] == prefetched, run
        assert (run["staleness"][0] == 0) == (run["what"] in ("first", "set")), run
    assert r["out"][4]["staleness"][60] == 0, r["out"][4]
