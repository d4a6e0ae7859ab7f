"""Keras's ``BackupAndRestore`` under a compressed strategy (internal).

A compressor's state (error-feedback residuals, DGC's momenta, PowerSGD's
``Q``) lives beside the model, one copy per replica, so Keras's callback does
not see it. :class:`CompressedBackupAndRestore` saves and restores it where
Keras's callback saves and restores the model; :func:`with_state_backups`
gives ``fit`` such a copy of each plain ``keras.callbacks.BackupAndRestore``
the user passed, so that the callback a Keras user reaches for resumes the
same training. The user's own callback objects are left as they are.
"""

import json
import os

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdist_ext")
class CompressedBackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also backs up the per-replica compressor state.

    Under a compressed strategy ``fit`` already runs a plain
    ``keras.callbacks.BackupAndRestore`` as this class: use either. The
    state is a ``tf.train.Checkpoint`` of ``strategy.compression_state`` in
    ``backup_dir/compression_state``, restored when training resumes, before
    the first step creates the state. On a multi-worker cluster each worker
    other than the chief backs up to a temporary directory (Keras's
    multi-worker convention), so its compressor state starts afresh on resume.

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
        strategy = self.strategy
        if strategy is None and self.model is not None:
            strategy = getattr(self.model, "distribute_strategy", None)
        if not hasattr(strategy, "compression_state"):
            raise ValueError(
                "CompressedBackupAndRestore: needs a compressed strategy, e.g. "
                "tfdist_ext.MirroredStrategy(compression=...) (pass strategy=... or build "
                f"the model under its scope), got {type(strategy).__name__}"
            )
        return strategy

    def _state_dir(self):
        return os.path.join(self.backup_dir, "compression_state")

    def _checkpoint(self):
        return tf.train.Checkpoint(compression=self._compressed_strategy().compression_state)

    def _load_model(self):
        latest = tf.train.latest_checkpoint(self._state_dir())
        if latest:
            self._check_same_compressor()
        super()._load_model()
        if latest:
            self._checkpoint().restore(latest)

    def _save_model(self):
        super()._save_model()
        tf.train.CheckpointManager(self._checkpoint(), self._state_dir(), max_to_keep=2).save()
        with open(os.path.join(self._state_dir(), _COMPRESSOR), "w") as f:
            json.dump(self._compressor_config(), f, sort_keys=True)

    def _compressor_config(self):
        compressor = self._compressed_strategy().compression
        return json.loads(json.dumps(keras.saving.serialize_keras_object(compressor)))

    def _check_same_compressor(self):
        """Refuses a backup whose compressor state another compressor made."""
        path = os.path.join(self._state_dir(), _COMPRESSOR)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        now = self._compressor_config()
        if saved != now:
            raise ValueError(
                f"CompressedBackupAndRestore: the backup in {self.backup_dir!r} holds the "
                f"state of the compressor {_describe(saved)}, but this strategy's is "
                f"{_describe(now)}; resume with the compressor the backup was made with, "
                "or give a new backup_dir to start afresh"
            )

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "double_checkpoint": self.double_checkpoint,
            "delete_checkpoint": self.delete_checkpoint,
        }


_COMPRESSOR = "compressor.json"  # the serialised compressor the state belongs to


def _describe(config):
    inner = config.get("config") if isinstance(config, dict) else None
    if not isinstance(inner, dict):
        return repr(config)
    arguments = ", ".join(f"{k}={v!r}" for k, v in sorted(inner.items()))
    return f"{config.get('class_name')}({arguments})"


def with_state_backups(strategy, callbacks):
    """``callbacks`` with each plain ``BackupAndRestore`` replaced by a
    :class:`CompressedBackupAndRestore` with the same settings."""
    if not isinstance(callbacks, (list, tuple)):
        return callbacks
    return [_with_state(strategy, callback) for callback in callbacks]


def _with_state(strategy, callback):
    if type(callback) is not keras.callbacks.BackupAndRestore:
        return callback
    return CompressedBackupAndRestore(
        callback.backup_dir,
        strategy=strategy,
        save_freq=callback.save_freq,
        double_checkpoint=callback.double_checkpoint,
        delete_checkpoint=callback.delete_checkpoint,
    )
