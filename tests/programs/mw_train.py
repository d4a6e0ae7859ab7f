"""A user's training script, unchanged under every launcher: ``python -m tests.programs.mw_train
STRATEGY OUT [--die TASK:EPOCH] [--input from_function]``.

STRATEGY is ``sync`` (``tfdist_ext.MultiWorkerMirroredStrategy``: every
worker runs this) or ``downpour`` (the chief runs this; the other tasks
serve). The cluster comes from ``TF_CONFIG``. Inputs are a dict of two
features; the checkpoints, TensorBoard logs and the BackupAndRestore backup
all go under OUT, one directory every task shares. ``--die TASK:EPOCH``
kills worker TASK at the end of EPOCH, once (a marker under OUT remembers).
``--input from_function``: each worker reads its own shard through
``strategy.distribute_datasets_from_function``. The chief prints ``RESULT`` with its history and what is under OUT.
"""

import argparse
import os
import signal

import keras
import tensorflow as tf

import tfdist_ext
from tests.programs import report

EPOCHS = 4


def dataset(batch):
    x, y = tfdist_ext.datasets.digits("train", flatten=True, as_numpy=True)
    features = {"left": x[:, :32], "right": x[:, 32:]}
    return tf.data.Dataset.from_tensor_slices((features, y)).shuffle(2048, seed=0).batch(batch)


def model():
    left, right = keras.Input((32,), name="left"), keras.Input((32,), name="right")
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()([left, right]))
    outputs = keras.layers.Dense(10)(hidden)
    model = keras.Model({"left": left, "right": right}, outputs)
    model.compile(
        keras.optimizers.Adam(0.003),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class DieOnce(keras.callbacks.Callback):
    """Kills this process (SIGKILL: no clean-up, as a lost machine) at an epoch's end, once."""

    def __init__(self, epoch, marker):
        super().__init__()
        self.epoch, self.marker = epoch, marker

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy", choices=("sync", "downpour"))
    parser.add_argument("out")
    parser.add_argument("--die")
    parser.add_argument("--input", choices=("dataset", "from_function"), default="dataset")
    args = parser.parse_args()
    if args.strategy == "sync":
        strategy = tfdist_ext.MultiWorkerMirroredStrategy()
    else:
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        strategy = tfdist_ext.DownpourStrategy(resolver)
    task = strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id
    with strategy.scope():
        net = model()
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt", "model-{epoch}.keras")),
        keras.callbacks.TensorBoard(os.path.join(args.out, "logs")),
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup")),
    ]
    if args.die:
        die_task, die_epoch = map(int, args.die.split(":"))
        if task == ("worker", die_task):
            callbacks.append(DieOnce(die_epoch, os.path.join(args.out, "died")))
    data, steps = dataset(64), None
    if args.input == "from_function":
        # Each worker reads its own shard (tf.distribute's per-worker input).
        def shard(context):
            batch = context.get_per_replica_batch_size(64)
            shard = dataset(batch).shard(context.num_input_pipelines, context.input_pipeline_id)
            # Every worker must have steps_per_epoch batches in every epoch:
            # one that runs out ends its epoch alone, out of step with the others.
            return shard.repeat()

        data, steps = strategy.distribute_datasets_from_function(shard), 10
    validation = dataset(64).take(4) if args.input == "dataset" else None
    history = net.fit(
        data,
        validation_data=validation,
        epochs=EPOCHS,
        steps_per_epoch=steps,
        verbose=0,
        callbacks=callbacks,
    )
    if strategy.extended.should_checkpoint:
        report(
            {
                "task": list(task),
                "epochs": history.epoch,
                "history": {k: [float(v) for v in vs] for k, vs in history.history.items()},
                "files": sorted(os.listdir(args.out)),
                "checkpoints": sorted(os.listdir(os.path.join(args.out, "ckpt"))),
                "workers": strategy.num_replicas_in_sync if args.strategy == "sync" else None,
            }
        )


if __name__ == "__main__":
    main()
