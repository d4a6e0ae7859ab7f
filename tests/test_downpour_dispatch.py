"""How many steps one Downpour dispatch runs, and what a push sends (issue 13).

A round (one ``ClusterCoordinator`` dispatch) runs many local steps, as
Keras's ``steps_per_execution`` does: the batches Keras's own iterator gives
the chief, ``steps_per_execution`` of them when set, at most about 50
otherwise (fewer when a worker idles), a multiple of ``lcm(n_fetch,
n_push)`` except an epoch's first and last. Fetch, push and step counts stay
those of ``n_fetch``/``n_push``. Each test runs its body in a fresh interpreter.
"""

import pytest

from tests.test_downpour import PRELUDE
from tests.test_downpour import _result

COUNT_ROUNDS = """
def count_rounds(strategy):
    # Counts the coordinator's dispatches of Downpour rounds.
    schedule = strategy.coordinator.schedule
    sizes = []
    def counting(fn, args=None, kwargs=None):
        if args and len(args) == 3:
            sizes.append(int(args[2]))
        return schedule(fn, args=args, kwargs=kwargs)
    strategy.coordinator.schedule = counting
    return sizes
"""


@pytest.mark.timeout(300)
def test_one_dispatch_runs_many_steps_with_n_fetch_n_push_kept(script):
    proc = script(
        PRELUDE
        + COUNT_ROUNDS
        + """
keras.utils.set_random_seed(0)
out = {}
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
    sizes = count_rounds(strategy)
    for name, n, spe in (("default-n1", 1, 1), ("default-n3", 3, 1), ("spe10-n1", 1, 10),
                         ("spe4-n3", 3, 4)):
        strategy.n_fetch = strategy.n_push = n
        strategy.stats.reset()
        del sizes[:]
        with strategy.scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"], steps_per_execution=spe)
        seen = []
        class Batches(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append(batch)
        h = model.fit(digits_train(), epochs=2, steps_per_epoch=120, verbose=0,
                      callbacks=[Batches()])
        s = strategy.stats.summary()
        out[name] = dict(sizes=list(sizes), batches=len(seen), loss=h.history["loss"],
                         steps=s["steps"], pushes=s["pushes"], fetches=s["fetches"],
                         prefetched=s["prefetched_rounds"],
                         iterations=int(model.optimizer.iterations.numpy()))
    report(**out)
""",
        timeout=280,
    )
    r = _result(proc)
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
        assert len(run["sizes"]) <= 2 * (120 // round_size + 3), (name, run["sizes"])
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


@pytest.mark.timeout(300)
def test_short_epochs_give_every_worker_rounds_pushes_batched_metrics_exact(script):
    proc = script(
        PRELUDE
        + COUNT_ROUNDS
        + """
keras.utils.set_random_seed(0)
with LocalCluster(num_workers=2, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, n_fetch=2, n_push=2)
    sizes = count_rounds(strategy)
    with strategy.scope():
        model = compile(mlp())
    train = datasets.digits("train", flatten=True).shuffle(2048, seed=0)
    train = train.batch(32, drop_remainder=True).repeat()
    h = model.fit(train, epochs=3, steps_per_epoch=40, verbose=0)
    s = strategy.stats.summary()
    first = dict(sizes=list(sizes), per_worker=strategy.stats.steps_per_worker,
                 pushes=s["pushes"], loss=h.history["loss"],
                 splits=op_devices(strategy, "SplitV"),
                 ps=[v.value.device for v in model.trainable_variables],
                 metric_counts={m.name: float(m.variables[-1].numpy()) for m in model.metrics
                                if m.name in ("loss",)})
    # Rounds of steps_per_execution steps: while the chief waits for an
    # epoch's first round, the other worker already has a round of its own.
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=10)
    strategy.stats.reset()
    del sizes[:]
    at_first_batch = []
    class FirstBatch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.marked = False
        def on_train_batch_end(self, batch, logs=None):
            if not self.marked:
                at_first_batch.append(len(sizes))
                self.marked = True
    model.fit(train, epochs=2, steps_per_epoch=40, verbose=0, callbacks=[FirstBatch()])
    report(**first, spe_sizes=list(sizes), at_first_batch=at_first_batch,
           spe_steps=strategy.stats.summary()["steps"],
           spe_iterations=int(model.optimizer.iterations.numpy()))
""",
        timeout=280,
    )
    r = _result(proc)
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
    # With steps_per_execution = 10: each of Keras's calls is one round of its
    # 10 batches, the epoch's first waited for (its logs are the callbacks'
    # first), and every step ran exactly once.
    assert r["at_first_batch"] == [1, 5], r["at_first_batch"]
    assert r["spe_sizes"] == [10] * 8, r["spe_sizes"]
    assert r["spe_steps"] == r["spe_iterations"] == 80, r


@pytest.mark.timeout(300)
def test_overlapped_push_and_fetch_lose_no_update_and_count_staleness(script):
    # A block's push is applied while the next block computes, and the
    # parameters of the next fetch point are read after that push. The loss
    # is the mean output, so every step's bias gradient is exactly 1: the
    # bias ends at -lr * steps only if every step's gradient is applied once.
    proc = script(
        PRELUDE
        + COUNT_ROUNDS
        + """
keras.utils.set_random_seed(0)
out = {}
with LocalCluster(num_workers=1, num_ps=1) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver)
    sizes = count_rounds(strategy)
    for n_fetch, n_push in ((1, 1), (2, 3), (4, 2)):
        strategy.n_fetch, strategy.n_push = n_fetch, n_push
        strategy.stats.reset()
        del sizes[:]
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)])
            model.compile(optimizer=keras.optimizers.SGD(0.01),
                          loss=lambda y, p: tf.reduce_mean(p))
        model.fit(digits_train(), epochs=2, steps_per_epoch=50, verbose=0)
        s = strategy.stats.summary()
        out[f"{n_fetch},{n_push}"] = dict(
            bias=float(model.layers[0].bias.numpy()[0]), sizes=list(sizes),
            staleness=[int(x) for x in strategy.stats.staleness], pushes=s["pushes"],
            fetches=s["fetches"], prefetched=s["prefetched_rounds"],
            iterations=int(model.optimizer.iterations.numpy()))
    report(**out)
""",
        timeout=280,
    )
    r = _result(proc)
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
def test_rounds_start_from_prefetched_parameters_until_weights_are_set(script):
    # One worker, 2 ps tasks with the hidden kernel split across them. A
    # round's last block fetches the next round's parameters; the worker's
    # next round starts from them, in the same epoch, the next epoch and a
    # fit right after (weights as the last epoch left them), but not after
    # set_weights between fits or in a callback at an epoch's start: that
    # epoch's first round fetches what was set. The loss is the mean
    # output, so the bias's gradient is exactly 1 whatever the staleness:
    # the bias ends at (what was set) - lr * steps only if every step's
    # gradient is applied exactly once.
    proc = script(
        PRELUDE
        + """
out = []
with LocalCluster(num_workers=1, num_ps=2) as cluster:
    strategy = tfdist_ext.DownpourStrategy(cluster.resolver, min_shard_bytes=1024)
    data = digits_train()
    with strategy.scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=lambda y, p: tf.reduce_mean(p),
                      steps_per_execution=20)
    split = isinstance(model.layers[0].kernel.value,
                       tfdist_ext._integration.ShardedVariable)
    def set_all(value):
        model.set_weights([np.full(w.shape, value, "float32") for w in model.get_weights()])
    class SetAtSecondEpoch(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                set_all(0.02)
    for what in ("first", "again", "set", "again", "callback"):
        if what == "set":
            set_all(0.01)
        bias = 0.02 if what == "callback" else float(model.layers[1].bias.numpy()[0])
        strategy.stats.reset()
        model.fit(data, epochs=2, steps_per_epoch=60, verbose=0,
                  callbacks=[SetAtSecondEpoch()] if what == "callback" else [])
        s = strategy.stats.summary()
        out.append(dict(what=what, fetches=s["fetches"], prefetched=s["prefetched_rounds"],
                        rounds=s["rounds"], staleness=list(strategy.stats.staleness),
                        bias_before=bias, bias=float(model.layers[1].bias.numpy()[0])))
report(out=out, split=split)
""",
        timeout=280,
    )
    r = _result(proc)
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
