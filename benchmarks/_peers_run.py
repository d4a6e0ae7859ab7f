"""One measured run for the ``peers`` benchmark, in its own process (internal).

``python -m benchmarks._peers_run '{"system": "...", ...}'`` prints one line
``RESULT {json}``. Systems:

* ``downpour`` (Keras 3, ``tfdist_ext.DownpourStrategy``) and ``pss``
  (``tf_keras``, ``tf.distribute.ParameterServerStrategy``): this process is
  the chief of a ``LocalCluster`` of 2 workers and 1 ps, plain
  ``tf.distribute.Server`` tasks.
* ``cmwms`` (Keras 3, ``tfdist_ext.MultiWorkerMirroredStrategy``,
  dense) and ``mwms`` (``tf_keras``, ``tf.distribute.MultiWorkerMirroredStrategy``):
  this process starts a ``LocalCluster`` whose 2 worker tasks run this module
  with ``--worker`` and their own ``TF_CONFIG``; worker 0's result, with the
  slower worker's seconds.
* ``keras3-mwms``: Keras 3 ``fit`` under plain ``MultiWorkerMirroredStrategy``,
  expected to fail; returns the last line of worker 0's error.

Every run trains a warm-up epoch (which traces), then ``epochs`` timed
epochs; after each it computes held-out accuracy in numpy from
``get_weights()``, the same code for every system, outside the timed
seconds. A ``tf_keras`` run never imports Keras 3 before
its result is printed (``keras3_loaded`` records it): the systems must not
share a process.
"""

import json
import os
import sys
import time

from benchmarks import _harness
from benchmarks._downpour_run import _cpu_seconds

BATCH = 64  # examples per worker step, every system
HIDDEN = {"digits": 128, "synthetic": 1024}
SYNTHETIC = {"train": 8192, "test": 2048, "inputs": 256, "noise": 6.0}
LR = 0.003
OURS = ("downpour", "easgd")  # this package's asynchronous strategies
LEGACY = ("pss", "mwms")  # the tf_keras systems


def _keras(system):
    if system in LEGACY:
        import tf_keras as keras
    else:
        import keras
    return keras


def data(case, seed):
    """``((x, y), (x_test, y_test))`` as numpy arrays."""
    from tfdist_ext import datasets

    if case == "digits":
        return (
            datasets.digits("train", flatten=True, as_numpy=True),
            datasets.digits("test", flatten=True, as_numpy=True),
        )
    n = SYNTHETIC["train"]
    x, y = datasets.synthetic(
        n + SYNTHETIC["test"],
        input_shape=(SYNTHETIC["inputs"],),
        noise=SYNTHETIC["noise"],
        seed=seed,
        as_numpy=True,
    )
    return (x[:n], y[:n]), (x[n:], y[n:])


def _model(keras, case, inputs, lr, steps_per_execution, optimizer=None):
    """The case's MLP, compiled with ``optimizer`` (default ``Adam(lr)``)."""
    hidden = HIDDEN[case]
    model = keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution or 1,
    )
    return model


def accuracy(weights, x, y):
    """Held-out accuracy of the Dense-ReLU MLP ``weights`` (kernel, bias, ...), in numpy."""
    import numpy as np

    h = x
    for i in range(0, len(weights), 2):
        h = h @ weights[i] + weights[i + 1]
        if i + 2 < len(weights):
            h = np.maximum(h, 0.0)
    return float((h.argmax(-1) == y).mean())


class _Curve:
    """Held-out accuracy against training seconds, marked at every epoch's end.

    The clock starts at the first ``fit`` (tracing and the warm-up epoch
    count, as they do for a user); the seconds spent reading the weights and
    scoring them are left out of it.
    """

    def __init__(self, keras, model, test):
        self.model, self.test = model, test
        self.points = [(0.0, accuracy(model.get_weights(), *test))]
        self.paused = 0.0
        self.start = time.perf_counter()
        self.callback = keras.callbacks.LambdaCallback(on_epoch_end=lambda *_: self.mark())

    def seconds(self):
        return time.perf_counter() - self.start - self.paused

    def mark(self):
        now, begin = self.seconds(), time.perf_counter()
        accuracy_now = accuracy(self.model.get_weights(), *self.test)
        self.paused += time.perf_counter() - begin
        self.points.append((now, accuracy_now))


def _link_bytes(pid):
    """Bytes received and sent so far on the interfaces of ``pid``'s network
    namespace but ``lo``."""
    with open(f"/proc/{pid}/net/dev") as f:
        return interface_bytes(f.read())


def interface_bytes(net_dev):
    """Bytes received plus sent on every interface but ``lo`` of a
    ``/proc/net/dev`` text; ``None`` if it has no other."""
    counted = []
    for line in net_dev.splitlines()[2:]:
        name, counters = line.split(":", 1)
        if name.strip() != "lo":
            fields = counters.split()
            counted.append(int(fields[0]) + int(fields[8]))
    return sum(counted) if counted else None


def _timed_fit(keras, model, train, cfg, steps, cpu_pids, test):
    """A warm-up epoch, then ``cfg["epochs"]`` timed epochs of ``steps`` steps: the
    timed seconds, CPU seconds per job, and the accuracy curve of both.

    An epoch is ``steps`` steps of a repeated, shuffled dataset (several passes
    over digits' 1347 examples): with ``steps_per_execution=50`` an epoch of
    one data pass (21 or 128 steps) would hold one to three executions, so one
    worker would idle for much of it. The warm-up epoch may be shorter
    (``cfg["warmup_steps"]``): it only has to trace every function.
    """
    curve = _Curve(keras, model, test)
    warmup = cfg.get("warmup_steps") or steps
    model.fit(train, epochs=1, steps_per_epoch=warmup, verbose=0, callbacks=[curve.callback])
    # The link of the ps (asynchronous) or of this worker (synchronous), in
    # its own namespace; on 127.0.0.1 every task shares the host's.
    link_pid = (cpu_pids.get("ps") or cpu_pids["worker"])[0] if cfg["isolated"] else None
    before = {job: _cpu_seconds(pids) for job, pids in cpu_pids.items()}
    link_before = None if link_pid is None else _link_bytes(link_pid)
    start = curve.seconds()
    model.fit(
        train, epochs=cfg["epochs"], steps_per_epoch=steps, verbose=0, callbacks=[curve.callback]
    )
    seconds = curve.seconds() - start
    cpu = {job: _cpu_seconds(pids) - before[job] for job, pids in cpu_pids.items()}
    link = None if link_before is None else _link_bytes(link_pid) - link_before
    return seconds, cpu, curve.points, link


# --- asynchronous: this process is the chief ---------------------------------------


def without_autotune(tf, ds):
    """``ds`` with tf.data's autotuning off, for every system alike.

    These pipelines have nothing to tune, and deleting an autotuned iterator
    (Keras does at each ``fit``'s end) can block for the rest of the
    tuner's sleep, a period that doubles towards a minute, when the CPU is
    contended: the tuner's thread misses the cancel's wake-up (reproduced
    in plain TensorFlow, see NOTES.md). Left on, that stall made one run in
    three to five of a row 9-18 s slower.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return ds.with_options(options)


def _async_input(tf, keras, cfg, x, y):
    """Training input: Downpour's chief reads one dataset and sends its batches;
    the peer gives each worker its own shard (TensorFlow's PSS tutorial)."""
    seed = cfg["seed"]
    if cfg["system"] in OURS:
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
        return without_autotune(tf, ds.batch(BATCH, drop_remainder=True).repeat())

    def dataset_fn(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        ds = ds.shuffle(len(x), seed=seed).batch(BATCH, drop_remainder=True).repeat()
        return without_autotune(tf, ds.prefetch(2))

    return keras.utils.experimental.DatasetCreator(dataset_fn)


def _async_strategy(tf, cfg, cluster):
    if cfg["system"] in OURS:
        import tfdist_ext

        if cfg["system"] == "easgd":
            return tfdist_ext.ElasticAveragingStrategy(cluster.resolver, tau=cfg["n"])
        fetch = {"background_fetch": cfg["background_fetch"]} if "background_fetch" in cfg else {}
        return tfdist_ext.DownpourStrategy(
            cluster.resolver, n_fetch=cfg["n"], n_push=cfg["n"], **fetch
        )
    return tf.distribute.ParameterServerStrategy(cluster.resolver)


def async_run(cfg):
    from tfdist_ext.cluster import LocalCluster

    cluster = LocalCluster(
        num_workers=2,
        num_ps=1,
        intra_op_threads=1,
        bandwidth=cfg.get("bandwidth"),
        isolated=cfg["isolated"],
    ).start()
    try:
        keras = _keras(cfg["system"])
        import tensorflow as tf

        (x, y), (xt, yt) = data(cfg["case"], cfg["seed"])
        keras.utils.set_random_seed(cfg["seed"])
        strategy = _async_strategy(tf, cfg, cluster)
        train = _async_input(tf, keras, cfg, x, y)
        with strategy.scope():
            model = _model(keras, cfg["case"], x.shape[1], LR, cfg.get("spe"))
        steps = cfg["steps"]
        pids = {
            "chief": [os.getpid()],
            "ps": [cluster.pid("ps", 0)],
            "worker": [cluster.pid("worker", i) for i in range(2)],
        }
        timed = _timed_fit(keras, model, train, cfg, steps, pids, (xt, yt))
        out = _summary(cfg, steps * BATCH, *timed)
        if cfg["system"] in OURS:
            out["staleness_mean"] = strategy.stats.summary()["staleness_mean"]
        _report(out)  # before the cluster stops (which imports tfdist_ext's Keras 3 glue)
        return out
    finally:
        cluster.stop()


def _summary(cfg, examples_per_epoch, seconds, cpu, curve, link):
    batches = cfg["epochs"] * examples_per_epoch // BATCH
    return {
        # Megabytes in and out on the ps's link (asynchronous) or a worker's
        # (synchronous) per BATCH examples, on 100 Mbit/s links only.
        "link_mb_per_batch": None if link is None else link / batches / 1e6,
        "examples_per_second": cfg["epochs"] * examples_per_epoch / seconds,
        "seconds": seconds,
        "accuracy": curve[-1][1],
        # (seconds since the first fit, held-out accuracy): before it, after
        # the warm-up epoch and after every timed epoch.
        "curve": curve,
        # Warm-up and timed epochs (every system alike; 2 workers' batches a
        # synchronous step).
        "examples_trained": BATCH
        * ((cfg.get("warmup_steps") or cfg["steps"]) + cfg["epochs"] * cfg["steps"]),
        # CPU milliseconds per BATCH examples trained, each kind of process
        # (a synchronous step trains two such batches, one per worker).
        "cpu_ms_per_batch": {job: 1e3 * c / batches for job, c in cpu.items()},
        "keras3_loaded": "keras" in sys.modules,
        "tf_keras_loaded": "tf_keras" in sys.modules,
    }


# --- synchronous: every worker runs the same program -------------------------------


def _sync_strategy(tf, cfg):
    if cfg["system"] == "cmwms":
        import tfdist_ext
        from tfdist_ext import compression

        if cfg.get("compression"):
            return tfdist_ext.MultiWorkerMirroredStrategy(
                compression=compression.get(cfg["compression"], ratio=cfg["ratio"])
            )
        return tfdist_ext.MultiWorkerMirroredStrategy()
    return tf.distribute.MultiWorkerMirroredStrategy()


def worker(cfg):
    """One worker of a synchronous run (its ``TF_CONFIG`` set by the cluster)."""
    keras = _keras(cfg["system"])
    import tensorflow as tf

    # As each LocalCluster server task of the asynchronous rows: ops on one
    # thread each (the machine's 2 cores are shared by the 2 workers).
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(3)
    strategy = _sync_strategy(tf, cfg)
    (x, y), (xt, yt) = data(cfg["case"], cfg["seed"])
    keras.utils.set_random_seed(cfg["seed"])
    train = without_autotune(tf, _harness.sharded_batches(tf, x, y, 2 * BATCH, cfg["seed"]))
    with strategy.scope():
        model = _model(keras, cfg["case"], x.shape[1], LR, cfg.get("spe"))
    # The same examples per epoch as the asynchronous rows: each step trains
    # one batch on each of the 2 workers.
    steps = cfg["steps"] // 2
    timing = dict(cfg, warmup_steps=(cfg.get("warmup_steps") or cfg["steps"]) // 2)
    timed = _timed_fit(keras, model, train, timing, steps, {"worker": [os.getpid()]}, (xt, yt))
    # This worker's CPU over both workers' examples: the launcher sums the two.
    return _summary(cfg, steps * 2 * BATCH, *timed)


def _sync_cluster(cfg):
    from tfdist_ext.cluster import LocalCluster

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return LocalCluster(
        num_workers=2,
        num_ps=0,
        chief=False,
        bandwidth=cfg.get("bandwidth"),
        isolated=cfg["isolated"],
        command=[sys.executable, "-m", "benchmarks._peers_run", "--worker", json.dumps(cfg)],
        env={"PYTHONPATH": repo, "TF_CPP_MIN_LOG_LEVEL": "2"},
        verbose=0,
    )


def sync_run(cfg):
    cluster = _sync_cluster(cfg)
    with cluster:
        codes = cluster.wait(timeout=cfg.get("timeout", 600))
        outputs = [cluster.output("worker", i) for i in range(2)]
    results = []
    for text in outputs:
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        results.append(json.loads(lines[-1][len("RESULT ") :]) if lines else None)
    if any(c != 0 for c in codes.values()) or None in results:
        raise RuntimeError(f"sync run {cfg} failed: {codes}\n" + outputs[0][-3000:])
    out = results[0]
    # Each worker timed its own fits; the run lasts as long as the slower one.
    out["seconds"] = max(r["seconds"] for r in results)
    out["examples_per_second"] = min(r["examples_per_second"] for r in results)
    out["cpu_ms_per_batch"]["worker"] = sum(r["cpu_ms_per_batch"]["worker"] for r in results)
    return out


def keras3_mwms(cfg):
    """Keras 3 ``fit`` under plain ``MultiWorkerMirroredStrategy``: worker 0's last error line."""
    cluster = _sync_cluster(dict(cfg, system="keras3-mwms"))
    with cluster:
        try:
            codes = cluster.wait(timeout=cfg.get("timeout", 180))
        except Exception as e:  # noqa: BLE001 - a hang is a result too
            codes = {"wait": repr(e)}
        text = cluster.output("worker", 0)
    lines = [l for l in text.splitlines() if l.strip()]
    starts = [i for i, l in enumerate(lines) if _is_error_line(l)]
    error = None
    if starts:
        # The message can span lines (it prints the PerReplica's arrays): its
        # first line and the output's last one.
        first, last = lines[starts[-1]], lines[-1].strip()
        error = first if starts[-1] == len(lines) - 1 else f"{first} ... {last}"
    return {"exit_codes": codes, "error": error, "tail": lines[-15:]}


def _is_error_line(line):
    """A traceback's last line, ``SomeError: message`` (no indentation)."""
    head = line.split(":", 1)[0]
    return (
        not line.startswith(" ")
        and head.replace(".", "").isidentifier()
        and (head.endswith("Error") or head.endswith("Exception"))
    )


def _keras3_worker(cfg):
    import keras
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    (x, y), _ = data(cfg["case"], cfg["seed"])
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * BATCH, drop_remainder=True)
    with strategy.scope():
        model = _model(keras, cfg["case"], x.shape[1], LR, None)
    model.fit(train.repeat(), epochs=1, steps_per_epoch=4, verbose=0)
    return {"trained": True}


def _report(out):
    print("RESULT " + json.dumps(out), flush=True)


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if sys.argv[1] == "--worker":
        cfg = json.loads(sys.argv[2])
        out = (_keras3_worker if cfg["system"] == "keras3-mwms" else worker)(cfg)
    else:
        cfg = json.loads(sys.argv[1])
        if cfg["system"] in (*OURS, "pss"):
            async_run(cfg)  # reports before its cluster stops
            return
        out = (keras3_mwms if cfg["system"] == "keras3-mwms" else sync_run)(cfg)
    _report(out)


if __name__ == "__main__":
    main()
