"""One measured run for the ``downpour`` benchmark, in its own process (internal).

``python -m benchmarks._downpour_run '{"task": "...", ...}'`` prints one line
``RESULT {json}``. Each run is a fresh interpreter: a process connects to one
TensorFlow cluster only, and logical CPU devices are fixed per process.
"""

import json
import os
import sys
import time

TARGETS = {"digits": 0.95, "mnist1d": 0.60}


def _data(name, seed):
    from tfdist_ext import datasets

    if name == "digits":
        return (datasets.digits("train", flatten=True), datasets.digits("test", flatten=True), 64)
    return (datasets.mnist1d("train"), datasets.mnist1d("test"), 40)


def _mlp(keras, inputs, hidden):
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _cnn(keras):
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _compile(keras, model, lr, optimizer="adagrad"):
    optimizers = {"adagrad": keras.optimizers.Adagrad, "sgd": keras.optimizers.SGD}
    model.compile(
        optimizer=optimizers[optimizer](lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _strategy(cfg):
    """(strategy or None, cluster or None) for the configured system."""
    system = cfg["system"]
    if system == "mirrored":
        import tensorflow as tf

        from tfdist_ext.cluster import logical_cpus

        return tf.distribute.MirroredStrategy(logical_cpus(2)), None
    if system == "keras":
        return None, None
    import tfdist_ext
    from tfdist_ext.cluster import LocalCluster

    cluster = LocalCluster(num_workers=cfg["workers"], num_ps=1, intra_op_threads=1).start()
    if system == "easgd":
        strategy = tfdist_ext.ElasticAveragingStrategy(
            cluster.resolver, tau=cfg["tau"], alpha=cfg.get("alpha")
        )
        return strategy, cluster
    policy = cfg.get("staleness_policy")  # {"class_name": ..., "config": ...} or None
    if policy is not None:
        policy = getattr(tfdist_ext.downpour, policy["class_name"])(**policy.get("config", {}))
    strategy = tfdist_ext.DownpourStrategy(
        cluster.resolver,
        n_fetch=cfg.get("n_fetch", cfg["n"]),
        n_push=cfg["n"],
        staleness_policy=policy,
        max_staleness=cfg.get("max_staleness"),
    )
    return strategy, cluster


def _cpu_seconds(pids):
    """User + system CPU seconds used so far by the processes ``pids`` (from ``/proc``)."""
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _tasks(cluster):
    """``{"chief": [pid], "ps": [...], "worker": [...]}``: this process and the cluster's."""
    tasks = {"chief": [os.getpid()], "ps": [], "worker": []}
    if cluster is not None:
        tasks["ps"] = [cluster.pid("ps", i) for i in range(cluster.num_ps)]
        tasks["worker"] = [cluster.pid("worker", i) for i in range(cluster.num_workers)]
    return tasks


def time_to_accuracy(cfg):
    import keras
    import tensorflow as tf

    if cfg["system"] == "keras":
        tf.config.threading.set_intra_op_parallelism_threads(2)
    strategy, cluster = _strategy(cfg)
    keras.utils.set_random_seed(cfg["seed"])
    train, test, inputs = _data(cfg["dataset"], cfg["seed"])
    replicas = 2 if cfg["system"] == "mirrored" else 1
    batch = 32 * replicas
    train = train.shuffle(4096, seed=cfg["seed"]).batch(batch).repeat()
    test = test.batch(500).cache()
    scope = strategy.scope() if strategy else _null()
    with scope:
        model = _compile(
            keras, _mlp(keras, inputs, cfg["hidden"]), cfg["lr"], cfg.get("optimizer", "adagrad")
        )
    if cfg.get("warmup"):  # traced before the clock starts (and before any throttle)
        model.fit(train, epochs=1, steps_per_epoch=cfg["warmup"], verbose=0)
        # Every function is registered on the cluster before the clock (and
        # the throttle) starts.
        model.evaluate(test, verbose=0)
        if strategy is not None and hasattr(strategy, "stats"):
            strategy.stats.reset()
    target = cfg.get("target", TARGETS[cfg["dataset"]])
    trained, curve, reached = 0.0, [], None
    with _throttled(cluster, cfg.get("slowdown")):
        while trained < cfg["budget"]:
            start = time.perf_counter()
            model.fit(train, epochs=1, steps_per_epoch=cfg["chunk"], verbose=0)
            trained += time.perf_counter() - start
            accuracy = float(model.evaluate(test, verbose=0)[1])
            curve.append([round(trained, 3), accuracy])
            if reached is None and accuracy >= target:
                reached = trained
    out = {
        "seconds_to_target": reached,
        "final_accuracy": curve[-1][1],
        "curve": curve,
        "target": target,
    }
    if cfg["system"] in ("downpour", "easgd"):
        summary = strategy.stats.summary()
        out.update(
            push_bytes_per_step=summary["push_bytes_per_step"],
            fetch_bytes_per_step=summary["fetch_bytes_per_step"],
            staleness=strategy.stats.staleness,
            steps_per_worker=strategy.stats.steps_per_worker,
            clock_leads=None
            if strategy.stats.clock_leads is None
            else strategy.stats.clock_leads.tolist(),
        )
    if cluster:
        _report(out)
    return out


def _throttled(cluster, slowdown):
    """Worker 1 slowed ``slowdown`` times (``LocalCluster.throttle``), or nothing."""
    if cluster is None or not slowdown:
        return _null()
    return cluster.throttle("worker", 1, slowdown=slowdown)


def throughput(cfg):
    import keras
    import tensorflow as tf

    from tfdist_ext import datasets

    if cfg["system"] == "keras":
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy, cluster = _strategy(cfg)
    keras.utils.set_random_seed(cfg["seed"])
    shape = (784,) if cfg["model"] == "mlp" else (28, 28, 1)
    batch = 64
    train = (
        datasets.synthetic(batch * 32, input_shape=shape, seed=cfg["seed"]).batch(batch).repeat()
    )
    scope = strategy.scope() if strategy else _null()
    with scope:
        model = _mlp(keras, 784, 512) if cfg["model"] == "mlp" else _cnn(keras)
        _compile(keras, model, 0.01)
    model.fit(train, epochs=1, steps_per_epoch=cfg["steps"] // 4, verbose=0)  # warm-up
    tasks = _tasks(cluster)
    cpu_before = {job: _cpu_seconds(pids) for job, pids in tasks.items()}
    start = time.perf_counter()
    model.fit(train, epochs=1, steps_per_epoch=cfg["steps"], verbose=0)
    seconds = time.perf_counter() - start
    cpu = {job: _cpu_seconds(pids) - cpu_before[job] for job, pids in tasks.items()}
    out = {
        "examples_per_second": batch * cfg["steps"] / seconds,
        "seconds": seconds,
        # CPU milliseconds per step (one batch of 64) of each kind of process,
        # all of its tasks together: what the machine's cores must supply.
        "cpu_ms_per_step": {job: 1e3 * c / cfg["steps"] for job, c in cpu.items()},
    }
    if cluster:
        out["steps_per_worker"] = strategy.stats.steps_per_worker
        _report(out)
    return out


def _round_parts(strategy, model):
    """The parts of a round as functions to schedule: ``(empty, fetch, push_zero)``."""
    import tensorflow as tf

    from tfdist_ext.downpour import _round
    from tfdist_ext.downpour import _staleness

    trainable = model.trainable_variables

    @tf.function
    def empty():
        return tf.constant(0)

    @tf.function
    def fetch():
        params = [tf.convert_to_tensor(v.value) for v in trainable]
        if hasattr(_round, "one_transfer_per_task"):  # absent from older checkouts
            homes = [_round.home(v) for v in trainable]
            params = _round.one_transfer_per_task(params, homes, to_ps=False)
        return tf.add_n([tf.reduce_sum(p) for p in params])

    push, _ = _round.make_push(
        strategy,
        model.optimizer,
        trainable,
        sum(_round.nbytes(v) for v in trainable),
        _round.LossScale(),
        _staleness.server_side(strategy, trainable, None),
        strategy._runtime.server_version(),
    )
    zero = tf.constant(0, tf.int64)

    @tf.function
    def push_zero():
        grads = [tf.zeros(v.shape, v.dtype) for v in trainable]
        accepted, _, _, _ = push(grads, [], tf.constant(1, tf.int64), (0, zero, zero))
        return accepted

    return empty, fetch, push_zero


def _cpu_shares(tasks, run):
    """Each task's CPU seconds per wall second while ``run()`` runs; its result."""
    before = {k: _cpu_seconds(v) for k, v in tasks.items()}
    start = time.perf_counter()
    result = run()
    wall = time.perf_counter() - start
    return {k: (_cpu_seconds(v) - before[k]) / wall for k, v in tasks.items()}, result


def profile(cfg):
    """Medians of the parts of a Downpour round (1 worker, 1 ps, MLP, batch 64).

    Each part is scheduled ``repeats`` times through the coordinator and
    timed on the chief: an empty function (the dispatch), a fetch of every
    parameter, a push of a zero gradient with the compiled Adagrad, and
    whole rounds of ``steps`` local steps; plus the CPU seconds each task
    process used per step during the rounds (from ``/proc``).
    """
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist_ext import datasets
    from tfdist_ext.downpour import _round

    strategy, cluster = _strategy(dict(cfg, system="downpour", workers=1))
    keras.utils.set_random_seed(cfg["seed"])
    batch, steps, repeats = 64, cfg.get("steps", 50), cfg.get("repeats", 15)
    train = datasets.synthetic(batch * 32, input_shape=(784,), seed=cfg["seed"])
    train = train.batch(batch).repeat()
    with strategy.scope():
        model = _compile(keras, _mlp(keras, 784, 512), 0.01)
    model.fit(train, epochs=1, steps_per_epoch=2 * steps, verbose=0)  # traces the round
    empty, fetch, push_zero = _round_parts(strategy, model)

    def timed(fn, args=(), kwargs=None):
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            strategy.coordinator.schedule(fn, args=args, kwargs=kwargs).fetch()
            out.append(time.perf_counter() - start)
        return float(np.median(out)) * 1e3

    out = {"empty_ms": timed(empty), "fetch_ms": timed(fetch), "push_ms": timed(push_zero)}
    tasks = _tasks(cluster)
    out["idle_cpu_share_per_task"], _ = _cpu_shares(tasks, lambda: time.sleep(2.0))
    runtime = strategy._runtime
    round_fn = runtime.round_for(model)
    batches = _round.round_input(list(train.take(steps)))
    args = (batches, runtime.worker_index(), tf.constant(steps, tf.int32))
    kwargs = {"prefetch": tf.constant(True)}  # as the chief schedules a round
    out["cpu_share_per_task"], round_ms = _cpu_shares(tasks, lambda: timed(round_fn, args, kwargs))
    out[f"round_{steps}_ms_per_step"] = round_ms / steps
    start = time.perf_counter()
    model.fit(train, epochs=1, steps_per_epoch=4 * steps, verbose=0)
    out["fit_ms_per_step"] = (time.perf_counter() - start) / (4 * steps) * 1e3
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _report(out):
    print("RESULT " + json.dumps(out), flush=True)


def main():
    cfg = json.loads(sys.argv[1])
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tasks = {"time_to_accuracy": time_to_accuracy, "throughput": throughput, "profile": profile}
    out = tasks[cfg["task"]](cfg)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
