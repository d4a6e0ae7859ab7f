"""Keras ``compile``/``fit`` features, each a small program as keras.io writes it.

``python -m tests.programs.conformance STRATEGY FEATURE [FEATURE ...]`` runs
every named feature twice, in plain Keras and under ``STRATEGY`` (one of
:data:`STRATEGIES`), and prints what each run showed: ``History``'s keys,
batches and examples trained per epoch, ``optimizer.iterations``, the last
loss and the feature's own observations -- or the error it raised and
whether any batch had started. :func:`judge` (used by
``tests/test_conformance.py``) turns the two into a cell's verdict.

The expectations come from Keras's documented behaviour (keras.io: "Training
& evaluation with the built-in methods", the callbacks' API pages), not from
tfdist_ext: plain Keras is run on the same program as the reference.
"""

import contextlib
import csv
import os
import re
import sys
import tempfile

import numpy as np

from tests.programs import report

#: The strategies the matrix covers.
STRATEGIES = (
    "downpour",
    "easgd",
    "sandblaster",
    "compressed_mirrored",
    "compressed_multiworker",
    "model_parallel_1",
    "model_parallel_2",
)

#: Keys a strategy adds to ``fit``'s logs (documented in its guide).
EXTRA_KEYS = {
    "downpour": {
        "staleness_mean",
        "staleness_max",
        "pushes",
        "rejected_pushes",
        "push_bytes_per_step",
        "fetch_bytes_per_step",
    },
    "sandblaster": {
        "iteration",
        "grad_max",
        "step_size",
        "function_evals",
        "coordinator_bytes",
        "backup_slices",
        "wasted_slices",
        "converged",
    },
}
EXTRA_KEYS["easgd"] = EXTRA_KEYS["downpour"]

#: Strategies whose steps are batches of fit's input, as Keras's are (not
#: Sandblaster's: one full-batch L-BFGS iteration a step).
BATCH_STEPS = set(STRATEGIES) - {"sandblaster"}
#: Strategies whose model moves by each example's own gradient, so the
#: programs' per-example counters show how often each example was trained
#: (not EASGD's: its centre moves by a share of a replica's difference).
PER_EXAMPLE = BATCH_STEPS - {"easgd"}
#: Strategies whose arithmetic is plain Keras's (synchronous, deterministic on
#: logical CPUs): their losses must agree with plain Keras's.
SAME_VALUES = {"compressed_mirrored", "compressed_multiworker", "model_parallel_1"}

FEATURES = {}  # name -> (program, the word a refusal must name)
#: Features whose epochs depend on the loss's values (a callback stops early).
VALUE_DEPENDENT = {"early_stopping"}
N, FEATURES_IN, CLASSES, BATCH = 300, 16, 4, 32


def feature(keyword):
    """Registers a feature program; a refusal of it must name ``keyword``."""

    def register(fn):
        FEATURES[fn.__name__] = (fn, keyword)
        return fn

    return register


# -- the user's side: data, model, callbacks ---------------------------------


def data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES_IN)).astype("float32")
    w = rng.normal(size=(FEATURES_IN, CLASSES))
    return x, np.argmax(x @ w, axis=1).astype("int32")


def mlp():
    import keras

    return keras.Sequential(
        [
            keras.Input((FEATURES_IN,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    )


class Counter:
    """Counts what Keras reports per epoch: batches, and the loss tracker's examples."""

    def __new__(cls):
        import keras

        class _Counter(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.began, self.steps, self.examples, self.batches = False, [], [], 0

            def on_epoch_begin(self, epoch, logs=None):
                self.batches = 0

            def on_train_batch_begin(self, batch, logs=None):
                self.began = True

            def on_train_batch_end(self, batch, logs=None):
                self.batches += 1

            def on_epoch_end(self, epoch, logs=None):
                self.steps.append(self.batches)
                # The "loss" Mean counts the examples whose loss it tracked.
                self.examples.append(float(self.model.metrics[0].variables[1].numpy()))

        return _Counter()


class Context:
    """One run of a feature: plain Keras (``strategy=None``) or under a strategy."""

    def __init__(self, name, strategy, directory):
        self.name, self.strategy, self.directory = name, strategy, directory
        self.counter = None

    def scope(self):
        return self.strategy.scope() if self.strategy else contextlib.nullcontext()

    def optimizer(self, learning_rate=0.05, **kwargs):
        import keras

        if self.name == "sandblaster":
            from tfdist_ext.optimizers import LBFGS

            return LBFGS(**kwargs)
        return keras.optimizers.SGD(learning_rate, **kwargs)

    def build(self, model_fn=mlp, learning_rate=0.05, optimizer_options=None, **compile_kwargs):
        """``model_fn()`` built and compiled in the strategy's scope, as keras.io does."""
        import keras

        keras.utils.set_random_seed(0)
        with self.scope():
            model = model_fn()
            compile_kwargs.setdefault(
                "loss", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
            compile_kwargs.setdefault("metrics", ["accuracy"])
            optimizer = self.optimizer(learning_rate, **(optimizer_options or {}))
            model.compile(optimizer=optimizer, **compile_kwargs)
        return model

    def fit(self, model, *args, callbacks=(), **kwargs):
        self.counter = Counter()
        kwargs.setdefault("verbose", 0)
        return model.fit(*args, callbacks=[self.counter, *callbacks], **kwargs)

    def path(self, name):
        return os.path.join(self.directory, name)


def observe(ctx, model, history, **own):
    """What a run showed, beside the feature's own observations ``own``."""
    losses = history.history.get("loss", [])
    return {
        "keys": sorted(history.history),
        "epochs": len(losses),
        "steps": ctx.counter.steps,
        "examples": ctx.counter.examples,
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss": float(losses[-1]) if losses else None,
        **own,
    }


# -- the features ----------------------------------------------------------


def counting_mlp():
    """``mlp`` beside a counter of the examples trained: an ``Embedding`` row per
    example id whose loss (the row's value, summed) has gradient 1 at every
    occurrence, so each row moves by the same amount for each time its
    example is trained -- under any optimizer step that applies gradients as
    SGD does, whatever the staleness."""
    import keras

    features = keras.Input((FEATURES_IN,), name="features")
    ids = keras.Input((), dtype="int32", name="id")
    hidden = keras.layers.Dense(16, activation="relu")(features)
    label = keras.layers.Dense(CLASSES, name="label")(hidden)
    seen = keras.layers.Embedding(N, 1, embeddings_initializer="ones", name="seen")(ids)
    return keras.Model({"features": features, "id": ids}, {"label": label, "seen": seen})


def counting_data():
    x, y = data()
    inputs = {"features": x, "id": np.arange(N, dtype="int32")}
    return inputs, {"label": y, "seen": np.zeros((N, 1), "float32")}


def trained_counts(model):
    """How often each example was trained, relative to the most trained: ``{share: examples}``."""
    moved = 1.0 - model.get_layer("seen").embeddings.numpy()[:, 0]
    shares = np.round(moved / max(moved.max(), 1e-12), 2)
    values, counts = np.unique(shares, return_counts=True)
    return {str(v): int(c) for v, c in zip(values, counts)}


def fit_counting(ctx, x, *args, **kwargs):
    """Fits :func:`counting_mlp` on ``x`` (and ``args``); its observation."""
    import keras

    model = ctx.build(
        counting_mlp,
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "seen": keras.losses.MeanAbsoluteError(reduction="sum"),
        },
        metrics={"label": ["accuracy"]},
        steps_per_execution=kwargs.pop("steps_per_execution", 1),
    )
    kwargs.setdefault("epochs", 2)
    h = ctx.fit(model, x, *args, **kwargs)
    return observe(ctx, model, h, trained=trained_counts(model))


@feature("numpy")
def numpy_arrays(ctx):
    x, y = counting_data()
    return fit_counting(ctx, x, y, batch_size=BATCH, shuffle=False)


@feature("shuffle")
def shuffled_numpy(ctx):
    x, y = counting_data()
    return fit_counting(ctx, x, y, batch_size=BATCH)


@feature("dataset")
def tf_data(ctx):
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(counting_data()).shuffle(N, seed=0).batch(BATCH)
    return fit_counting(ctx, ds)


@feature("steps_per_epoch")
def steps_per_epoch(ctx):
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(counting_data()).batch(BATCH).repeat()
    return fit_counting(ctx, ds, steps_per_epoch=7)


def _py_dataset(workers=1, use_multiprocessing=False):
    import keras

    x, y = counting_data()

    def rows(nest, index):
        return {k: v[index * BATCH : (index + 1) * BATCH] for k, v in nest.items()}

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return -(-N // BATCH)

        def __getitem__(self, index):
            return rows(x, index), rows(y, index)

    return Batches(workers=workers, use_multiprocessing=use_multiprocessing)


@feature("PyDataset")
def py_dataset(ctx):
    return fit_counting(ctx, _py_dataset())


@feature("PyDataset")
def py_dataset_threads(ctx):
    return fit_counting(ctx, _py_dataset(workers=2))


@feature("PyDataset")
def py_dataset_processes(ctx):
    return fit_counting(ctx, _py_dataset(workers=2, use_multiprocessing=True))


@feature("generator")
def generator(ctx):
    x, y = counting_data()

    def batches():
        while True:
            for i in range(0, N, BATCH):
                yield (
                    {k: v[i : i + BATCH] for k, v in x.items()},
                    {k: v[i : i + BATCH] for k, v in y.items()},
                )

    return fit_counting(ctx, batches(), steps_per_epoch=-(-N // BATCH))


@feature("steps_per_execution")
def steps_per_execution(ctx):
    x, y = counting_data()
    return fit_counting(ctx, x, y, batch_size=BATCH, shuffle=False, steps_per_execution=3)


def _two_outputs():
    import keras

    inputs = keras.Input((FEATURES_IN,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    label = keras.layers.Dense(CLASSES, name="label")(hidden)
    score = keras.layers.Dense(1, name="score")(hidden)
    return keras.Model(inputs, {"label": label, "score": score})


@feature("loss")
def per_output_losses(ctx):
    import keras

    x, y = data()
    model = ctx.build(
        _two_outputs,
        loss={
            "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "score": "mse",
        },
        loss_weights={"label": 1.0, "score": 0.5},
        metrics={"label": ["accuracy"], "score": ["mae"]},
    )
    targets = {"label": y, "score": (y / CLASSES).astype("float32")[:, None]}
    h = ctx.fit(model, x, targets, batch_size=BATCH, epochs=2, shuffle=False)
    return observe(ctx, model, h, per_output_positive=bool(h.history["score_loss"][-1] > 0))


def fit_mlp(ctx, epochs=2, callbacks=(), build=None, **fit_kwargs):
    """:func:`mlp` built by ``ctx.build(**build)`` and fitted on :func:`data`
    in batches of ``BATCH``, unshuffled; ``(model, history)``."""
    x, y = data()
    model = ctx.build(**(build or {}))
    fit_kwargs.update(batch_size=BATCH, epochs=epochs, shuffle=False, callbacks=list(callbacks))
    return model, ctx.fit(model, x, y, **fit_kwargs)


@feature("class_weight")
def class_weight(ctx):
    model, h = fit_mlp(ctx, class_weight={0: 1.0, 1: 2.0, 2: 0.5, 3: 1.0})
    return observe(ctx, model, h)


@feature("sample_weight")
def sample_weight(ctx):
    model, h = fit_mlp(ctx, sample_weight=np.linspace(0.5, 1.5, N).astype("float32"))
    return observe(ctx, model, h)


@feature("validation")
def validation_data(ctx):
    xv, yv = data(96, seed=1)
    model, h = fit_mlp(ctx, validation_data=(xv, yv))
    evaluated = model.evaluate(xv, yv, verbose=0)[0]
    same = abs(h.history["val_loss"][-1] - evaluated) < 1e-4
    return observe(ctx, model, h, val_is_evaluate=bool(same))


@feature("validation_split")
def validation_split(ctx):
    model, h = fit_mlp(ctx, validation_split=0.2)
    return observe(ctx, model, h)


@feature("validation_freq")
def validation_freq(ctx):
    model, h = fit_mlp(ctx, epochs=3, validation_data=data(96, seed=1), validation_freq=2)
    return observe(ctx, model, h, val_epochs=len(h.history.get("val_loss", [])))


@feature("jit_compile")
def jit_compile(ctx):
    model, h = fit_mlp(ctx, build={"jit_compile": True}, validation_data=data(96, seed=1))
    evaluated = model.evaluate(*data(), verbose=0)[0]
    return observe(ctx, model, h, evaluated=bool(np.isfinite(evaluated)))


@feature("gradient_accumulation_steps")
def gradient_accumulation(ctx):
    options = {"gradient_accumulation_steps": 2}
    model, h = fit_mlp(ctx, build={"optimizer_options": options})
    return observe(ctx, model, h)


@feature("initial_epoch")
def initial_epoch(ctx):
    model, h = fit_mlp(ctx, epochs=3, initial_epoch=1)
    return observe(ctx, model, h, history_epochs=h.epoch)


@feature("stop_training")
def stop_training(ctx):
    import keras

    class StopAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == min(3, self.params["steps"] - 1):
                self.model.stop_training = True

    model, h = fit_mlp(ctx, epochs=3, callbacks=[StopAtBatch()])
    return observe(ctx, model, h)


@feature("EarlyStopping")
def early_stopping(ctx):
    import keras

    xv, yv = data(96, seed=1)
    stop = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True)
    model, h = fit_mlp(
        ctx, epochs=4, build={"learning_rate": 0.5}, validation_data=(xv, yv), callbacks=[stop]
    )
    best = min(h.history["val_loss"])
    restored = model.evaluate(xv, yv, verbose=0)[0]
    return observe(ctx, model, h, restored_best=bool(abs(restored - best) < 1e-4 * max(1, best)))


@feature("ReduceLROnPlateau")
def reduce_lr_on_plateau(ctx):
    import keras

    # min_delta this large makes every epoch a plateau: the rate halves each epoch.
    reduce = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=100.0, min_lr=0.0
    )
    start = float(ctx.optimizer().learning_rate)
    model, h = fit_mlp(ctx, epochs=3, callbacks=[reduce])
    rate = float(model.optimizer.learning_rate.numpy()) / start
    return observe(ctx, model, h, learning_rate_share=round(rate, 6))


@feature("LearningRateScheduler")
def learning_rate_scheduler(ctx):
    import keras

    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1))
    model, h = fit_mlp(ctx, epochs=3, callbacks=[schedule])
    rates = [round(float(v), 6) for v in h.history.get("learning_rate", [])]
    return observe(ctx, model, h, learning_rates=rates)


@feature("ModelCheckpoint")
def model_checkpoint(ctx):
    import keras

    path = ctx.path(f"{ctx.name}.keras")
    model, h = fit_mlp(ctx, callbacks=[keras.callbacks.ModelCheckpoint(path, monitor="loss")])
    loaded = keras.models.load_model(path, compile=False)
    same = all(np.allclose(a, b) for a, b in zip(loaded.get_weights(), model.get_weights()))
    return observe(ctx, model, h, checkpoint_is_final=bool(same))


@feature("BackupAndRestore")
def backup_and_restore(ctx):
    import keras

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if batch == min(4, self.params["steps"] - 1) and self.epoch == 1:
                raise RuntimeError("interrupted")

    backup = ctx.path(f"backup-{ctx.name}")
    with contextlib.suppress(RuntimeError):
        fit_mlp(ctx, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()])
    model, h = fit_mlp(ctx, epochs=3, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    resumed = len(h.history["loss"])
    return observe(ctx, model, h, resumed_epochs=resumed, backup_removed=not os.path.exists(backup))


@feature("TensorBoard")
def tensorboard(ctx):
    import keras

    logs = ctx.path(f"tb-{ctx.name}")
    model, h = fit_mlp(ctx, callbacks=[keras.callbacks.TensorBoard(logs)])
    walk = os.walk(os.path.join(logs, "train"))
    events = [f for _, _, files in walk for f in files if f.startswith("events.out")]
    return observe(ctx, model, h, train_event_files=bool(events))


@feature("CSVLogger")
def csv_logger(ctx):
    import keras

    path = ctx.path(f"{ctx.name}.csv")
    model, h = fit_mlp(ctx, callbacks=[keras.callbacks.CSVLogger(path)])
    with open(path) as f:
        rows = list(csv.reader(f))
    return observe(ctx, model, h, csv_header=rows[0], csv_rows=len(rows) - 1)


@feature("evaluate")
def evaluate_predict_after_fit(ctx):
    x, y = data()
    model, h = fit_mlp(ctx)
    plain = mlp()
    plain.set_weights(model.get_weights())
    plain.compile(loss=model.loss, metrics=["accuracy"])
    agree = np.allclose(model.predict(x, verbose=0), plain.predict(x, verbose=0), atol=1e-5)
    evaluated = model.evaluate(x, y, verbose=0, return_dict=True)
    expected = plain.evaluate(x, y, verbose=0, return_dict=True)
    same = all(abs(evaluated[k] - expected[k]) < 1e-4 for k in expected)
    return observe(ctx, model, h, predict_agrees=bool(agree), evaluate_agrees=bool(same))


@feature("train_on_batch")
def on_batch(ctx):
    x, y = data()
    model = ctx.build()
    losses = [model.train_on_batch(x[i : i + BATCH], y[i : i + BATCH]) for i in (0, 32, 64)]
    tested = model.test_on_batch(x[:BATCH], y[:BATCH])
    predicted = model.predict_on_batch(x[:BATCH])
    return {
        "keys": [],
        "epochs": 0,
        "steps": [],
        "examples": [],
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss": None,
        "shapes": [np.shape(losses[0]), np.shape(tested), list(np.shape(predicted))],
    }


# -- running and judging -----------------------------------------------------


def run(name, strategy, features, directory):
    """Each feature's observation (or its error) in plain Keras or under ``strategy``."""
    out = {}
    for feature_name in features:
        fn, _ = FEATURES[feature_name]
        ctx = Context(name, strategy, directory)
        try:
            out[feature_name] = fn(ctx)
        except Exception as e:  # noqa: BLE001 - the cell records what the user would see
            began = ctx.counter is not None and ctx.counter.began
            out[feature_name] = {"error": f"{type(e).__name__}: {e}"[:2000], "began": began}
    return out


@contextlib.contextmanager
def strategy_for(name):
    """The strategy ``name`` (its cluster running, for the parameter-server ones)."""
    import tfdist_ext

    devices = [f"/device:CPU:{i}" for i in range(2)]
    if name == "tf_mirrored":  # TensorFlow's own, for comparison (not in the matrix)
        import tensorflow as tf

        yield tf.distribute.MirroredStrategy(devices)
    elif name == "compressed_mirrored":
        yield tfdist_ext.CompressedMirroredStrategy(devices=devices)
    elif name.startswith("model_parallel_"):
        microbatches = int(name.rsplit("_", 1)[1])
        yield tfdist_ext.ModelParallelStrategy(devices, microbatches=microbatches)
    elif name == "compressed_multiworker":
        yield tfdist_ext.CompressedMultiWorkerMirroredStrategy()
    else:
        with tfdist_ext.LocalCluster(num_workers=2, num_ps=1) as cluster:
            kinds = {
                "downpour": tfdist_ext.DownpourStrategy,
                "easgd": tfdist_ext.ElasticAveragingStrategy,
                "sandblaster": tfdist_ext.SandblasterStrategy,
            }
            yield kinds[name](cluster.resolver)


def main(argv):
    name, features = argv[0], argv[1:]
    from tfdist_ext.cluster import logical_cpus

    logical_cpus(4)
    with tempfile.TemporaryDirectory() as directory:
        if name == "keras":
            # Plain Keras alone: the reference for the multi-worker column,
            # run apart from its workers (a process that forks PyDataset
            # workers after the collective runtime started did not end).
            report({"keras": run("keras", None, features, directory)})
        elif name == "compressed_multiworker":
            # The workers share the strategy's files (the chief's checkpoints
            # and backups), as on a shared file system.
            shared = os.environ.get("CONFORMANCE_SHARED_DIR", directory)
            with strategy_for(name) as strategy:
                report({name: run(name, strategy, features, shared)})
        else:
            keras_runs = run("keras", None, features, directory)
            with strategy_for(name) as strategy:
                runs = run(name, strategy, features, directory)
            report({"keras": keras_runs, name: runs})


def judge(strategy, feature_name, keras_run, run):
    """``("works" | "refused", why)`` for a cell, or ``("FAIL", what differs)``."""
    keyword = FEATURES[feature_name][1]
    if "error" in keras_run:
        return "FAIL", f"plain Keras failed: {keras_run['error']}"
    if "error" in run:
        if not run["began"] and keyword.lower() in run["error"].lower():
            return "refused", run["error"]
        return "FAIL", f"raised {'after' if run['began'] else 'without naming ' + keyword}: " + run[
            "error"
        ]
    problems = _differences(strategy, feature_name, keras_run, run)
    return ("FAIL", "; ".join(problems)) if problems else ("works", "")


def _differences(strategy, feature_name, keras_run, run):
    keys, expected = set(run["keys"]), set(keras_run["keys"])
    problems = []
    if expected - keys:
        problems.append(f"History lacks {sorted(expected - keys)}")
    if keys - expected - EXTRA_KEYS.get(strategy, set()):
        problems.append(f"History has unexpected {sorted(keys - expected)}")
    # Where a callback acts on the loss's values, only the same arithmetic
    # stops at the same epoch.
    counted = strategy in SAME_VALUES or feature_name not in VALUE_DEPENDENT
    if counted and run["epochs"] != keras_run["epochs"]:
        problems.append(f"{run['epochs']} epochs, Keras {keras_run['epochs']}")
    if counted and strategy in BATCH_STEPS:
        for what in ("steps", "examples", "iterations"):
            if run[what] != keras_run[what]:
                problems.append(f"{what} {run[what]}, Keras {keras_run[what]}")
    if strategy in SAME_VALUES and keras_run["loss"] is not None:
        if abs(run["loss"] - keras_run["loss"]) > 1e-3 * max(1.0, abs(keras_run["loss"])):
            problems.append(f"loss {run['loss']:.6f}, Keras {keras_run['loss']:.6f}")
    extra = EXTRA_KEYS.get(strategy, set())
    for key, value in keras_run.items():
        if key in ("keys", "epochs", "steps", "examples", "iterations", "loss"):
            continue
        if key == "trained" and strategy not in PER_EXAMPLE:
            continue
        if key == "csv_header":  # CSVLogger writes a val_ column for every key
            extra_columns = extra | {f"val_{k}" for k in extra}
            run = dict(run, csv_header=[k for k in run[key] if k not in extra_columns])
        if run.get(key) != value and not _close(run.get(key), value):
            problems.append(f"{key} {run.get(key)!r}, Keras {value!r}")
    return problems


def _close(a, b):
    try:
        return np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-4, atol=1e-6)
    except (TypeError, ValueError):
        return False


# -- the table of docs/api/guides/keras_compatibility.rst ------------------------

TABLE_START = "<!-- conformance table: python -m tests.programs.conformance table -->"
TABLE_END = "<!-- end of conformance table -->"
_NAMES = {
    "downpour": "Downpour",
    "easgd": "EASGD",
    "sandblaster": "Sandblaster",
    "compressed_mirrored": "MirroredStrategy",
    "compressed_multiworker": "MultiWorkerMirrored",
    "model_parallel_1": "ModelParallel",
    "model_parallel_2": "ModelParallel (2 micro-batches)",
}


def table(results):
    """Markdown: a row per feature, a column per strategy, refusals footnoted."""
    strategies = [s for s in STRATEGIES if s in results]
    notes = []
    lines = [
        "| feature | " + " | ".join(_NAMES[s] for s in strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    for feature_name in FEATURES:
        cells = []
        for strategy in strategies:
            verdict, why = results[strategy].get(feature_name, ("", ""))
            if verdict == "refused":
                reason = _first_sentence(why)
                if reason not in notes:
                    notes.append(reason)
                cells.append(f"refused ({notes.index(reason) + 1})")
            else:
                cells.append({"works": "yes", "": "not run"}.get(verdict, verdict))
        lines.append(f"| `{feature_name}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return "\n".join(lines)


def _first_sentence(error):
    """The reason an error gives, without its type, owner and a model's name."""
    reason = error.split(": ", 2)[-1].split(". ")[0].rstrip(".")
    return re.sub(r" of model '[^']*'", "", reason)


SUMMARY_START = "<!-- conformance summary: python -m tests.programs.conformance table -->"
SUMMARY_END = "<!-- end of conformance summary -->"


def summary(results):
    """Markdown for the README: per strategy, how many features work and which are refused."""
    lines = [
        "| strategy | works as in plain Keras | refused at `fit` start, naming the feature |",
        "|---|---|---|",
    ]
    for strategy in (s for s in STRATEGIES if s in results):
        verdicts = {f: results[strategy].get(f, ("", ""))[0] for f in FEATURES}
        works = sum(v == "works" for v in verdicts.values())
        refused = ", ".join(f"`{f}`" for f, v in verdicts.items() if v == "refused")
        lines.append(f"| {_NAMES[strategy]} | {works} of {len(FEATURES)} | {refused or 'none'} |")
    return "\n".join(lines)


def _replace_between(path, start_marker, end_marker, body):
    with open(path) as f:
        text = f.read()
    start = text.index(start_marker) + len(start_marker)
    end = text.index(end_marker)
    with open(path, "w") as f:
        f.write(text[:start] + "\n" + body + "\n" + text[end:])


def write_table(results_path, page_path, readme_path=None):
    """The full table into ``page_path``, the summary into ``readme_path`` (if given)."""
    import json

    with open(results_path) as f:
        results = json.load(f)
    _replace_between(page_path, TABLE_START, TABLE_END, table(results))
    if readme_path:
        _replace_between(readme_path, SUMMARY_START, SUMMARY_END, summary(results))


if __name__ == "__main__":
    if sys.argv[1:2] == ["table"]:
        # python -m tests.programs.conformance table [RESULTS.json [PAGE [README]]]:
        # PAGE (default: the Keras-compatibility guide) holds the table's two
        # markers, README (default: README.md) the summary's.
        defaults = ["docs/conformance.json", "docs/api/guides/keras_compatibility.rst", "README.md"]
        args = sys.argv[2:] + defaults[len(sys.argv[2:]) :]
        write_table(*args[:3])
    else:
        main(sys.argv[1:])
