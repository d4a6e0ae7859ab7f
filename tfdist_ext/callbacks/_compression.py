"""A Keras callback logging the bytes a compressed strategy put on the wire (internal)."""

import os
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


@keras.saving.register_keras_serializable(package="tfdist_ext")
class CompressedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also backs up the per-replica compressor state.

    Keras' callback saves the model and optimizer weights; the error-feedback
    residuals and DGC momenta of a compressed strategy live outside the model,
    so this callback writes them next to the weights (a ``tf.train.Checkpoint``
    of ``strategy.compression_state`` in ``backup_dir/compression_state``) and
    restores them when
    training resumes, before the first step creates them.

    Args:
      backup_dir: as for ``BackupAndRestore``.
      strategy: the compressed strategy; default ``model.distribute_strategy``.
      **kwargs: ``save_freq``, ``double_checkpoint``, ``delete_checkpoint``.

    Example:
      >>> cb = CompressedBackupAndRestore("/tmp/backup")
      >>> model.fit(ds, epochs=10, callbacks=[cb])   # doctest: +SKIP
    """

    def __init__(self, backup_dir: str, strategy: tf.distribute.Strategy | None = None, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.strategy = strategy

    def _compressed_strategy(self):
        return CompressionLogger(self.strategy)._bind(self.model)

    def _state_dir(self):
        return os.path.join(self.backup_dir, "compression_state")

    def _checkpoint(self):
        strategy = self._compressed_strategy()
        return tf.train.Checkpoint(compression=strategy.compression_state)

    def _load_model(self):
        super()._load_model()
        latest = tf.train.latest_checkpoint(self._state_dir())
        if latest:
            self._checkpoint().restore(latest)

    def _save_model(self):
        super()._save_model()
        ckpt = self._checkpoint()
        tf.train.CheckpointManager(ckpt, self._state_dir(), max_to_keep=2).save()

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "double_checkpoint": self.double_checkpoint,
            "delete_checkpoint": self.delete_checkpoint,
        }
