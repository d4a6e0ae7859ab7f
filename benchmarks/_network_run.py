"""One measured run for the ``network`` benchmark, in its own process (internal).

``python -m benchmarks._network_run '{"system": "...", ...}'`` prints one line
``RESULT {json}``. Two kinds of run:

* ``system="sync"``: a 2-worker ``CompressedMultiWorkerMirroredStrategy``
  program. This process starts a rate-limited ``LocalCluster`` whose worker
  tasks run this same module with ``--worker``; each worker measures its
  compute time per step (the same train step on a local copy of the model, no
  communication, both workers at once), then trains in one ``fit``, reading
  its own veth counters (``/proc/self/net/dev`` in its namespace) and
  evaluating held-out accuracy every ``chunk`` steps.
* ``system="downpour"``: this process is the chief of a ``DownpourStrategy``
  over 2 workers and ``ps`` shards; it trains one ``fit`` per chunk (see
  :func:`train_in_fits`) and reads the counters of every task's namespace
  through ``/proc/PID/net/dev``.

Training seconds exclude evaluation and a first warm-up fit (which traces).
A run stops once held-out accuracy reaches ``target`` (when given), after ``max_steps`` steps, or once training
seconds pass ``budget_seconds``.
"""

import json
import os
import statistics
import sys
import time

from benchmarks import _harness

BATCH = 64  # per worker
EVAL_EXAMPLES = 1000


def model(keras, hidden):
    """The MLP on MNIST-1D: 40 -> hidden -> hidden -> 10."""
    return keras.Sequential(
        [
            keras.Input((40,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def parameters(hidden):
    return 40 * hidden + hidden + hidden * hidden + hidden + hidden * 10 + 10


def net_bytes(pid="self"):
    """(received, transmitted) bytes on every interface but ``lo`` of ``pid``'s namespace."""
    with open(f"/proc/{pid}/net/dev") as f:
        return parse_net_dev(f.read())


def parse_net_dev(text):
    """(received, transmitted) bytes of a ``/proc/*/net/dev`` table, ``lo`` left out."""
    rx = tx = 0
    for line in text.splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() == "lo":
            continue
        fields = data.split()
        rx += int(fields[0])
        tx += int(fields[8])
    return rx, tx


def _compressor(C, method, steps_per_epoch):
    if method == "dense":
        return None, 0.9
    if method == "fp16":
        return C.FP16(), 0.9
    if method == "powersgd":
        return C.PowerSGD(2), 0.9
    if method == "dgc":
        # Momentum correction lives in the compressor (optimizer momentum 0);
        # no warm-up on this short schedule; tensors < 1024 entries go dense.
        return (
            C.DGC(
                sparsity=0.999,
                momentum=0.9,
                clip_norm=5.0,
                warmup_epochs=0,
                min_size=1024,
                steps_per_epoch=steps_per_epoch,
            ),
            0.0,
        )
    raise ValueError(f"unknown method {method!r}")


def _data(seed):
    from tfdist_ext import datasets

    (x, y) = datasets.mnist1d("train", as_numpy=True)
    (xt, yt) = datasets.mnist1d("test", as_numpy=True)
    return (x, y), (xt[:EVAL_EXAMPLES], yt[:EVAL_EXAMPLES])


def _accuracy(net, x, y):
    import numpy as np

    logits = np.asarray(net(x, training=False))
    return float((logits.argmax(-1) == y).mean())


def train(keras, net, dataset, cfg, accuracy, counters, warmup):
    """Trains ``net`` in one ``fit``, evaluating every ``cfg["chunk"]`` steps.

    A first, untimed fit of ``warmup`` steps traces the training functions;
    its steps count towards the schedule, its seconds do not. The clock stops
    while the callback reads the counters and evaluates.
    """
    net.fit(dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
    progress = _progress(keras)(cfg, accuracy, counters, warmup)
    net.fit(
        dataset.skip(warmup),
        epochs=1,
        steps_per_epoch=cfg["max_steps"] - warmup,
        verbose=0,
        callbacks=[progress],
    )
    return {
        "curve": progress.curve,
        "seconds_to_target": progress.reached,
        "chunks": progress.chunks,
        "steps": progress.curve[-1][0],
    }


def train_in_fits(net, dataset, cfg, accuracy, counters, warmup):
    """Downpour: trains ``net`` one ``fit`` of ``cfg["chunk"]`` steps at a time, evaluating between.

    Downpour's rounds run asynchronously: during a single ``fit`` the
    workers keep training while a callback evaluates, so a callback's clock
    and byte counters would miss the steps and bytes of the rounds in
    flight. Each ``fit`` returns only when all of its rounds have finished,
    so every timed chunk holds exactly its steps, their seconds (including
    the rounds' drain at the chunk's end) and their bytes. A first, untimed
    fit of ``warmup`` steps traces.
    """
    net.fit(dataset, epochs=1, steps_per_epoch=warmup, verbose=0)
    curve, chunks = [[warmup, 0.0, accuracy()]], []
    done, trained, reached = warmup, 0.0, None
    target, budget = cfg.get("target"), cfg.get("budget_seconds", float("inf"))
    while done < cfg["max_steps"] and reached is None and trained < budget:
        steps = min(cfg["chunk"], cfg["max_steps"] - done)
        before = counters()
        start = time.perf_counter()
        net.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        seconds = time.perf_counter() - start
        chunks.append(
            {
                "seconds": seconds,
                "steps": steps,
                "step_times": [seconds / steps],
                "before": before,
                "after": counters(),
            }
        )
        done, trained = done + steps, trained + seconds
        curve.append([done, round(trained, 3), accuracy()])
        if target is not None and curve[-1][2] >= target:
            reached = trained
    return {"curve": curve, "seconds_to_target": reached, "chunks": chunks, "steps": done}


def _progress(keras):
    class Progress(keras.callbacks.Callback):
        def __init__(self, cfg, accuracy, counters, warmup):
            super().__init__()
            self.cfg, self.accuracy, self.counters, self.warmup = cfg, accuracy, counters, warmup
            self.curve = [[warmup, 0.0, accuracy()]]
            self.chunks, self.reached, self.trained, self.done, self.seen = [], None, 0.0, 0, 0

        def on_train_begin(self, logs=None):
            self._open_chunk()

        def _open_chunk(self):
            self.step_times, self.before = [], self.counters()
            self.chunk_start = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            self.step_start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step_times.append(time.perf_counter() - self.step_start)
            self.seen = batch + 1
            if self.seen - self.done >= self.cfg["chunk"]:
                self._evaluate()
                self._open_chunk()

        def on_train_end(self, logs=None):
            # The last, partial chunk; Downpour's last rounds also finish here.
            if self.seen > self.done:
                self._evaluate()
            else:
                self._close_chunk(self.done)

        def _evaluate(self):
            self._close_chunk(self.seen)
            accuracy = self.accuracy()
            self.curve.append([self.warmup + self.done, round(self.trained, 3), accuracy])
            target = self.cfg.get("target")
            hit = target is not None and accuracy >= target and self.reached is None
            if hit:
                self.reached = self.trained
            over = self.trained >= self.cfg.get("budget_seconds", float("inf"))
            # Each worker reads its own clock: both must stop after the same
            # step, or their next collectives would not match.
            if self._any_worker(hit or over):
                self.model.stop_training = True

        def _any_worker(self, flag):
            """``flag`` OR-ed over the workers (one small all-reduce)."""
            import tensorflow as tf

            strategy = self.model.distribute_strategy
            value = strategy.run(lambda: tf.constant(1.0 if flag else 0.0))
            return float(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)) > 0

        def _close_chunk(self, steps):
            seconds = time.perf_counter() - self.chunk_start
            self.chunks.append(
                {
                    "seconds": seconds,
                    "steps": steps - self.done,
                    "step_times": self.step_times,
                    "before": self.before,
                    "after": self.counters(),
                }
            )
            self.done, self.trained = steps, self.trained + seconds

    return Progress


def _summarise(out, chunks):
    """Step time and bytes per step over the timed chunks."""
    steps = sum(c["steps"] for c in chunks) or 1
    out["step_seconds"] = statistics.median(t for c in chunks for t in c["step_times"])
    out["chunk_step_seconds"] = sum(c["seconds"] for c in chunks) / steps
    links = {}
    for c in chunks:
        for name, (rx0, tx0) in c["before"].items():
            rx1, tx1 = c["after"][name]
            link = links.setdefault(name, [0, 0])
            link[0] += rx1 - rx0
            link[1] += tx1 - tx0
    out["link_bytes_per_step"] = {k: [v[0] / steps, v[1] / steps] for k, v in links.items()}
    out["timed_steps"] = steps


# --- synchronous all-reduce: the worker program ---------------------------------


def _compute_seconds(tf, keras, cfg, x, y, repeats):
    """Median seconds of one local train step (forward, backward, SGD update), no communication."""
    local = model(keras, cfg["hidden"])
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    xb, yb = tf.constant(x[:BATCH]), tf.constant(y[:BATCH])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, local(xb, training=True))
        grads = tape.gradient(loss, local.trainable_variables)
        optimizer.apply(grads, local.trainable_variables)
        return loss

    step().numpy()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _one_thread(tf):
    """A synchronous worker's threads: ops on one thread each, two at once.

    The ``compute`` task times the train step in the same setting, so that
    its compute is the workers' own.
    """
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)


def worker(cfg):
    import keras
    import tensorflow as tf

    _one_thread(tf)
    from tfdist_ext import compression as C

    (x, y), (xt, yt) = _data(cfg["seed"])
    steps_per_epoch = len(x) // (2 * BATCH)
    compressor, momentum = _compressor(C, cfg["method"], steps_per_epoch)
    strategy = C.CompressedMultiWorkerMirroredStrategy(compression=compressor)
    compute = _compute_seconds(tf, keras, cfg, x, y, cfg["compute_repeats"])
    keras.utils.set_random_seed(cfg["seed"])
    train_data = _harness.sharded_batches(tf, x, y, 2 * BATCH, cfg["seed"])
    with strategy.scope():
        net = model(keras, cfg["hidden"])
        net.compile(
            keras.optimizers.SGD(cfg["lr"], momentum=momentum),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    out = train(
        keras,
        net,
        train_data,
        cfg,
        lambda: _accuracy(net, xt, yt),
        lambda: {"self": net_bytes()},
        1,
    )
    _summarise(out, out.pop("chunks"))
    out["compute_seconds"] = compute
    stats = strategy.compression_stats()
    out["compressor_bytes_per_step"] = stats["wire_bytes"] / max(1, stats["steps"])
    out["compress_seconds_per_step"] = stats["seconds"] / max(1, stats["steps"])
    return out


def sync(cfg):
    from tfdist_ext.cluster import LocalCluster

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cluster = LocalCluster(
        num_workers=2,
        num_ps=0,
        chief=False,
        bandwidth=cfg["bandwidth"],
        isolated=True,  # bandwidth None: the same namespaces and veths, no rate limit
        command=[sys.executable, "-m", "benchmarks._network_run", "--worker", json.dumps(cfg)],
        env={"PYTHONPATH": repo, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    with cluster:
        codes = cluster.wait(timeout=cfg.get("timeout", 1500))
        outputs = [cluster.output("worker", i) for i in range(2)]
    results = []
    for text in outputs:
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT ") :]) if lines else None)
    if any(c != 0 for c in codes.values()) or None in results:
        raise RuntimeError(f"sync run {cfg} failed: {codes}\n" + outputs[0][-3000:])
    out = results[0]
    out["link_bytes_per_step"] = {
        f"worker:{i}": r["link_bytes_per_step"]["self"] for i, r in enumerate(results)
    }
    out["compute_seconds"] = max(r["compute_seconds"] for r in results)
    out["step_seconds"] = max(r["step_seconds"] for r in results)
    return out


# --- Downpour: this process is the chief ----------------------------------------


def round_steps(cfg):
    """Steps per Downpour round (``steps_per_execution``) of a configuration.

    ``cfg["round"]``; configurations recorded before it was set ran rounds
    of a quarter chunk (at least n steps), two a worker.
    """
    return cfg.get("round") or max(cfg["n"], cfg["chunk"] // 4)


def downpour(cfg):
    import keras
    import tensorflow as tf

    import tfdist_ext
    from tfdist_ext.cluster import LocalCluster

    cluster = LocalCluster(
        num_workers=2,
        num_ps=cfg["ps"],
        bandwidth=cfg["bandwidth"],
        isolated=True,
        intra_op_threads=1,
    ).start()
    try:
        # The background fetch: on these links a fetch is slow next to compute,
        # the case it is for (the default fetches after the worker's own push).
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver, n_fetch=cfg["n"], n_push=cfg["n"], background_fetch=True
        )
        (x, y), (xt, yt) = _data(cfg["seed"])
        keras.utils.set_random_seed(cfg["seed"])
        train_data = (
            tf.data.Dataset.from_tensor_slices((x, y))
            .shuffle(len(x), seed=cfg["seed"])
            .batch(BATCH, drop_remainder=True)
            .repeat()
        )
        with strategy.scope():
            net = model(keras, cfg["hidden"])
            net.compile(
                keras.optimizers.Adagrad(cfg["downpour_lr"]),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                steps_per_execution=round_steps(cfg),
            )
        tasks = {f"task{i}": pid for i, pid in enumerate(cluster.pids())}

        def counters():
            return {name: net_bytes(pid) for name, pid in tasks.items()}

        out = train_in_fits(
            net, train_data, cfg, lambda: _accuracy(net, xt, yt), counters, cfg["chunk"] // 2
        )
        _summarise(out, out.pop("chunks"))
        summary = strategy.stats.summary()
        out.update(
            push_bytes_per_step=summary["push_bytes_per_step"],
            fetch_bytes_per_step=summary["fetch_bytes_per_step"],
            staleness_mean=summary["staleness_mean"],
            # Rounds that started from parameters prefetched in their
            # worker's previous round (the warm-up fit's first ones did not).
            prefetched_fraction=summary["prefetched_rounds"] / max(1, summary["rounds"]),
        )
        return out
    finally:
        cluster.stop()


def compute(cfg):
    """The train step's compute alone, on one thread (as each synchronous worker times it)."""
    import keras
    import tensorflow as tf

    _one_thread(tf)
    (x, y), _ = _data(cfg["seed"])
    return {"compute_seconds": _compute_seconds(tf, keras, cfg, x, y, cfg["compute_repeats"])}


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if sys.argv[1] == "--worker":
        out = worker(json.loads(sys.argv[2]))
    else:
        cfg = json.loads(sys.argv[1])
        out = {"sync": sync, "downpour": downpour, "compute": compute}[cfg["system"]](cfg)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
