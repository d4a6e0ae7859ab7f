"""Keras's ``BackupAndRestore`` under a compressed strategy (internal).

A compressor's state (error-feedback residuals, DGC's momenta, PowerSGD's
``Q``) lives beside the model, one copy per replica, so Keras's callback does
not see it. :class:`CompressorState` is what a compressed strategy's
``_backup_state`` gives ``tfdist_ext._state_backup``'s callback to save and
restore; :class:`CompressedBackupAndRestore` is that callback under its
public name.
"""

import json
import os

import keras
import tensorflow as tf

from tfdist_ext._state_backup import StateBackupAndRestore
from tfdist_ext._state_backup import with_state_backups as _with_state_backups


@keras.saving.register_keras_serializable(package="tfdist_ext")
class CompressedBackupAndRestore(StateBackupAndRestore):
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

    def _state(self):
        strategy = self._strategy()
        if not hasattr(strategy, "compression_state"):
            raise ValueError(
                "CompressedBackupAndRestore: needs a compressed strategy, e.g. "
                "tfdist_ext.MirroredStrategy(compression=...) (pass strategy=... or build "
                f"the model under its scope), got {type(strategy).__name__}"
            )
        return super()._state()


class CompressorState:
    """A compressed strategy's ``compression_state`` in a backup, with the
    serialised compressor it belongs to."""

    name = "compression_state"

    def __init__(self, strategy):
        self.strategy = strategy

    def _checkpoint(self):
        return tf.train.Checkpoint(compression=self.strategy.compression_state)

    def check(self, directory):
        """Whether ``directory`` holds a backup; refuses another compressor's."""
        if not tf.train.latest_checkpoint(directory):
            return False
        path = os.path.join(directory, _COMPRESSOR)
        if not os.path.exists(path):
            return True
        with open(path) as f:
            saved = json.load(f)
        now = self._compressor_config()
        if saved != now:
            raise ValueError(
                f"CompressedBackupAndRestore: the backup in {os.path.dirname(directory)!r} "
                f"holds the state of the compressor {_describe(saved)}, but this "
                f"strategy's is {_describe(now)}; resume with the compressor the backup "
                "was made with, or give a new backup_dir to start afresh"
            )
        return True

    def restore(self, directory):
        # Deferred: the state's variables are made by the first step, and
        # take their saved values then.
        self._checkpoint().restore(tf.train.latest_checkpoint(directory))

    def save(self, directory):
        tf.train.CheckpointManager(self._checkpoint(), directory, max_to_keep=2).save()
        with open(os.path.join(directory, _COMPRESSOR), "w") as f:
            json.dump(self._compressor_config(), f, sort_keys=True)

    def _compressor_config(self):
        compressor = self.strategy.compression
        return json.loads(json.dumps(keras.saving.serialize_keras_object(compressor)))


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
    return _with_state_backups(strategy, callbacks, CompressedBackupAndRestore)
