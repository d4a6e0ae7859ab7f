"""What ``background_fetch`` does to the steps: ``python -m tests.programs.fetch_order``.

One worker, ``DownpourStrategy(n_fetch=1, n_push=1)``, plain SGD, K batches.
With ``background_fetch=False`` each fetch follows the worker's own last
push, so the run must be Keras's K sequential SGD steps. With the background
fetch each step computes without the worker's own last push (staleness 1).
Prints the distances of both runs' weights to the sequential steps', and
their staleness.
"""

import numpy as np
import tensorflow as tf

import tfdist_ext
from tests.programs import report
from tests.programs.push_sum import BATCH
from tests.programs.push_sum import LR
from tests.programs.push_sum import compiled
from tests.programs.push_sum import distance
from tests.programs.push_sum import model

K = 8


def downpour(cluster, initial, x, y, background_fetch):
    strategy = tfdist_ext.DownpourStrategy(
        cluster.resolver, n_fetch=1, n_push=1, background_fetch=background_fetch
    )
    with strategy.scope():
        net = compiled(model(), LR, 1)
        net.set_weights(initial)
    # After the strategy: each one connects this process anew.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    net.fit(data, epochs=1, verbose=0)
    return net.get_weights(), [int(s) for s in strategy.stats.staleness]


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(K * BATCH, 8)).astype("float32")
    y = rng.integers(0, 3, size=K * BATCH)
    initial = model().get_weights()
    sequential = compiled(model(), LR, 1)
    sequential.set_weights(initial)
    sequential.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    # Read before the cluster: connecting makes this process's variables unreachable.
    k_steps = sequential.get_weights()

    out = {"moved": distance(k_steps, initial)}
    with tfdist_ext.LocalCluster(num_workers=1, num_ps=1) as cluster:
        for name, background in (("after_push", False), ("background", True)):
            weights, staleness = downpour(cluster, initial, x, y, background)
            out[name] = {"to_sequential": distance(weights, k_steps), "staleness": staleness}
    report(out)


if __name__ == "__main__":
    main()
