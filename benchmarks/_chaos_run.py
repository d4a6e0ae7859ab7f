"""One training job of the ``chaos`` benchmark, written as a user writes it (internal).

``python -m benchmarks._chaos_run '{json cfg}'``, with the cluster in
``TF_CONFIG``. ``cfg["system"]``: ``downpour`` or ``easgd`` (this process is
the chief; the cluster's other tasks serve) or ``sync``
(``tfdist_ext.MultiWorkerMirroredStrategy``: every worker runs this, started
by ``tfdist-ext launch``). The job is the ``peers`` benchmark's digits MLP
under ``Adagrad(0.05)``, trained for ``cfg["epochs"]`` epochs of
``cfg["steps"]`` steps with ``keras.callbacks.BackupAndRestore`` under
``cfg["out"]``, so a relaunched job resumes from its last completed epoch. It prints ``EPOCH_BEGIN e`` and
``EPOCH_END e`` as epochs go, and the chief ends with ``RESULT {json}``
(held-out accuracy). A worker writes its process id to ``out/pid-worker-N``
as it starts, for the benchmark to kill it.
"""

import json
import os
import sys

import keras
import tensorflow as tf

import tfdist_ext
from benchmarks import _harness
from benchmarks._peers_run import _model
from benchmarks._peers_run import accuracy
from benchmarks._peers_run import data

BATCH = 64  # examples per worker step
# Adagrad, Downpour's own server optimizer: over ten minutes of async
# training Adam(0.003) let one undisturbed Downpour run collapse to 0.67
# held-out accuracy, which would make every comparison here meaningless.
ADAGRAD_LR = 0.05


def strategy_for(cfg):
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if cfg["system"] == "sync":
        return tfdist_ext.MultiWorkerMirroredStrategy(resolver)
    if cfg["system"] == "easgd":
        return tfdist_ext.ElasticAveragingStrategy(resolver, deadline=cfg["deadline"])
    return tfdist_ext.DownpourStrategy(resolver, deadline=cfg["deadline"])


def training_data(cfg, strategy, x, y):
    if cfg["system"] == "sync":
        return _harness.sharded_batches(
            tf, x, y, BATCH * strategy.num_replicas_in_sync, cfg["seed"]
        )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=cfg["seed"])
        .batch(BATCH, drop_remainder=True)
        .repeat()
    )


def epoch_lines():
    def say(what, epoch):
        print(f"{what} {epoch}", flush=True)

    return keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: say("EPOCH_BEGIN", epoch),
        on_epoch_end=lambda epoch, logs: say("EPOCH_END", epoch),
    )


def main(cfg):
    keras.utils.set_random_seed(cfg["seed"])
    strategy = strategy_for(cfg)
    task = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    if task[0] == "worker":
        with open(os.path.join(cfg["out"], f"pid-worker-{task[1]}"), "w") as f:
            f.write(str(os.getpid()))
    (x, y), test = data("digits", cfg["seed"])
    with strategy.scope():
        optimizer = keras.optimizers.Adagrad(ADAGRAD_LR)
        model = _model(keras, "digits", x.shape[1], None, None, optimizer=optimizer)
    model.fit(
        training_data(cfg, strategy, x, y),
        epochs=cfg["epochs"],
        steps_per_epoch=cfg["steps"],
        verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(os.path.join(cfg["out"], "backup")),
            epoch_lines(),
        ],
    )
    if task[0] == "chief" or task == ("worker", 0):
        print(
            "RESULT " + json.dumps({"accuracy": accuracy(model.get_weights(), *test)}), flush=True
        )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
