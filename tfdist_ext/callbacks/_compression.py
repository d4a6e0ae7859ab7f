"""A Keras callback logging the bytes a compressed strategy put on the wire (internal)."""

import time

import keras
import tensorflow as tf

from tfdist_ext.compression._strategy import _CompressedExchange


@keras.saving.register_keras_serializable(package="tfdist_ext")
class CompressionLogger(keras.callbacks.Callback):
    """Logs, per epoch, the bytes sent, the dense bytes they replace, the ratio and the time.

    Reads the counters of a :class:`~tfdist_ext.CompressedMirroredStrategy` or
    :class:`~tfdist_ext.CompressedMultiWorkerMirroredStrategy` (the model's
    strategy by default); the counters are incremented inside the training
    step from the tensors that are actually all-gathered. Adds to the epoch
    logs (so they land in ``History``):

    * ``wire_bytes``: bytes this process' replicas sent during the epoch;
    * ``dense_bytes``: bytes a dense float32 exchange of the same gradients sends;
    * ``compression_ratio``: ``dense_bytes / wire_bytes``;
    * ``compress_seconds``: time compressing, averaged over the local replicas;
    * ``compress_fraction``: ``compress_seconds`` over the epoch's wall time.

    The per-epoch rows are also kept in :attr:`history`.

    Args:
      strategy: the compressed strategy; default ``model.distribute_strategy``.
      verbose: 1 prints one line per epoch.

    Raises:
      ValueError: (at the start of training) the strategy is not a compressed one.

    Example:
      >>> logger = CompressionLogger(verbose=1)
      >>> model.fit(ds, epochs=3, callbacks=[logger])   # doctest: +SKIP
      >>> logger.history[-1]["compression_ratio"]       # doctest: +SKIP
      512.0
    """

    KEYS = (
        "wire_bytes",
        "dense_bytes",
        "compression_ratio",
        "compress_seconds",
        "compress_fraction",
    )

    def __init__(self, strategy: tf.distribute.Strategy | None = None, verbose: int = 0):
        super().__init__()
        if verbose not in (0, 1):
            raise ValueError(f"CompressionLogger: verbose must be 0 or 1, got {verbose!r}")
        self.strategy = strategy
        self.verbose = verbose
        self.history = []
        self._start = None

    def _strategy(self):
        return self._bind(self.model)

    def _bind(self, model):
        strategy = self.strategy
        if strategy is None and model is not None:
            strategy = getattr(model, "distribute_strategy", None)
        if not isinstance(strategy, _CompressedExchange):
            raise ValueError(
                "CompressionLogger: needs a CompressedMirroredStrategy or "
                "CompressedMultiWorkerMirroredStrategy (pass strategy=... or build the "
                f"model under its scope), got {type(strategy).__name__}"
            )
        return strategy

    def on_train_begin(self, logs=None):
        self._strategy()

    def on_epoch_begin(self, epoch, logs=None):
        self._start = (self._strategy().compression_stats(), time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        strategy = self._strategy()
        before, t0 = self._start
        wall = time.perf_counter() - t0
        now = strategy.compression_stats()
        replicas = max(1, len(strategy.extended.worker_devices))
        wire = now["wire_bytes"] - before["wire_bytes"]
        dense = now["dense_bytes"] - before["dense_bytes"]
        seconds = (now["seconds"] - before["seconds"]) / replicas
        row = {
            "epoch": epoch,
            "wire_bytes": float(wire),
            "dense_bytes": float(dense),
            "compression_ratio": float(dense / wire) if wire else float("nan"),
            "compress_seconds": float(seconds),
            "compress_fraction": float(seconds / wall) if wall > 0 else float("nan"),
        }
        self.history.append(row)
        if logs is not None:
            logs.update({k: row[k] for k in self.KEYS})
        if self.verbose:
            print(
                f"compression epoch {epoch + 1}: sent {wire / 1e6:.3f} MB for "
                f"{dense / 1e6:.3f} MB dense (x{row['compression_ratio']:.1f}), "
                f"{seconds:.3f}s compressing ({100 * row['compress_fraction']:.1f}%)"
            )

    def get_config(self):
        return {"verbose": self.verbose}
