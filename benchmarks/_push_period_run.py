"""One run of the ``push_period`` benchmark, in its own process (internal).

``python -m benchmarks._push_period_run '{"system": ..., ...}'`` prints one
line ``RESULT {json}``: the held-out accuracy after each third of the run's
examples (``accuracy``), and for Downpour the staleness it measured.

* ``downpour``: ``DownpourStrategy(n_fetch=n_push=k, background_fetch=...)``
  on a ``LocalCluster`` of ``workers`` workers and 1 ps, ``steps`` steps of
  64 examples.
* ``delayed``: one Keras process applying Adam to gradients computed on the
  weights of ``delay`` updates before (0: plain Keras steps), each update
  of ``k`` batches of 64: the staleness alone, with no cluster.
"""

import json
import os
import sys

from benchmarks._peers_run import BATCH
from benchmarks._peers_run import LR
from benchmarks._peers_run import _model
from benchmarks._peers_run import accuracy
from benchmarks._peers_run import data

MARKS = 3  # accuracy marked after each third of the examples


def _dataset(tf, x, y, batch, seed):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed)
    return ds.batch(batch, drop_remainder=True).repeat()


def downpour(cfg):
    import keras
    import tensorflow as tf

    import tfdist_ext
    from tfdist_ext.cluster import LocalCluster

    (x, y), test = data("digits", cfg["seed"])
    k, marks = cfg["k"], []
    with LocalCluster(num_workers=cfg["workers"], num_ps=1, intra_op_threads=1) as cluster:
        keras.utils.set_random_seed(cfg["seed"])
        strategy = tfdist_ext.DownpourStrategy(
            cluster.resolver,
            n_fetch=k,
            n_push=k,
            background_fetch=cfg["background_fetch"],
        )
        with strategy.scope():
            model = _model(keras, "digits", x.shape[1], LR, None)
        train = _dataset(tf, x, y, BATCH, cfg["seed"])
        for _ in range(MARKS):
            model.fit(train, epochs=1, steps_per_epoch=cfg["steps"] // MARKS, verbose=0)
            marks.append(accuracy(model.get_weights(), *test))
        staleness = strategy.stats.summary()["staleness_mean"]
    return {"accuracy": marks, "staleness_mean": staleness}


def delayed(cfg):
    """Adam on gradients ``cfg["delay"]`` updates old, ``steps / k`` updates of ``k`` batches."""
    import keras
    import tensorflow as tf

    (x, y), test = data("digits", cfg["seed"])
    keras.utils.set_random_seed(cfg["seed"])
    model = _model(keras, "digits", x.shape[1], LR, None)
    weights, optimizer = model.trainable_variables, model.optimizer
    optimizer.build(weights)
    batches = iter(_dataset(tf, x, y, BATCH * cfg["k"], cfg["seed"]))
    history = [[w.numpy() for w in weights]]  # the weights after each update
    updates, marks = cfg["steps"] // cfg["k"], []
    for update in range(updates):
        xb, yb = next(batches)
        now = history[-1]
        for w, old in zip(weights, history[max(0, len(history) - 1 - cfg["delay"])]):
            w.assign(old)
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x=xb, y=yb, y_pred=model(xb))
        grads = tape.gradient(loss, weights)
        for w, value in zip(weights, now):
            w.assign(value)
        optimizer.apply_gradients(zip(grads, weights))
        history = history[-cfg["delay"] - 1 :] + [[w.numpy() for w in weights]]
        if (update + 1) % (updates // MARKS) == 0:
            marks.append(accuracy(model.get_weights(), *test))
    return {"accuracy": marks}


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cfg = json.loads(sys.argv[1])
    out = (downpour if cfg["system"] == "downpour" else delayed)(cfg)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
