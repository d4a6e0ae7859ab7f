"""Keras's ``BackupAndRestore`` for what a strategy keeps beside the model (internal).

Some strategies keep state between steps that is neither a model nor an
optimizer variable, so Keras's callback does not see it: a compressor's
error feedback (``compression/_backup.py``), EASGD's replicas
(``downpour/_elastic_backup.py``). Such a strategy has a method
``_backup_state(model)`` returning an object with ``name`` (a directory of
the backup), ``check(directory)``, ``save(directory)`` and
``restore(directory)``. :class:`StateBackupAndRestore` saves and restores it
where Keras's callback saves and restores the model; :func:`with_state_backups`
gives ``fit`` such a copy of each plain ``keras.callbacks.BackupAndRestore``
the user passed, so that the callback a Keras user reaches for resumes the
same training. The user's own callback objects are left as they are.
"""

import inspect
import os

import keras


class StateBackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also backs up the strategy's own state.

    Args:
      backup_dir: as for ``BackupAndRestore``.
      strategy: the strategy; default ``model.distribute_strategy``.
      **kwargs: ``save_freq``, ``double_checkpoint``, ``delete_checkpoint``.
    """

    def __init__(self, backup_dir, strategy=None, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.strategy = strategy

    def _strategy(self):
        strategy = self.strategy
        if strategy is None and self.model is not None:
            strategy = getattr(self.model, "distribute_strategy", None)
        return strategy

    def _state(self):
        """The strategy's state object for this model (see the module docstring)."""
        strategy = self._strategy()
        if not hasattr(strategy, "_backup_state"):
            raise ValueError(
                f"{type(self).__name__}: {type(strategy).__name__} keeps no state beside "
                "the model; use keras.callbacks.BackupAndRestore"
            )
        return strategy._backup_state(self.model)

    def _load_model(self):
        state = self._state()
        directory = os.path.join(self.backup_dir, state.name)
        saved = state.check(directory)  # refuses a backup of other state first
        super()._load_model()
        if saved:
            state.restore(directory)

    def _save_model(self):
        super()._save_model()
        state = self._state()
        state.save(os.path.join(self.backup_dir, state.name))

    def get_config(self):
        return {
            "backup_dir": self.backup_dir,
            "save_freq": self.save_freq,
            "double_checkpoint": self.double_checkpoint,
            "delete_checkpoint": self.delete_checkpoint,
        }


def with_state_backups(strategy, callbacks, cls=StateBackupAndRestore):
    """``callbacks`` with each plain ``BackupAndRestore`` replaced by a ``cls``
    (a :class:`StateBackupAndRestore`) with the same settings."""
    if not isinstance(callbacks, (list, tuple)):
        return callbacks
    return [_with_state(strategy, callback, cls) for callback in callbacks]


def _with_state(strategy, callback, cls):
    if type(callback) is not keras.callbacks.BackupAndRestore:
        return callback
    return cls(
        callback.backup_dir,
        strategy=strategy,
        save_freq=callback.save_freq,
        double_checkpoint=callback.double_checkpoint,
        delete_checkpoint=callback.delete_checkpoint,
    )


def fit_with_state_backups(strategy, keras_fit, model, args, kwargs):
    """``fit``'s ``(args, kwargs)`` (``model`` apart) with the callbacks
    :func:`with_state_backups` gives."""
    call = inspect.signature(keras_fit).bind(model, *args, **kwargs)
    callbacks = call.arguments.get("callbacks")
    if callbacks is None:
        return args, kwargs
    call.arguments["callbacks"] = with_state_backups(strategy, callbacks)
    return call.args[1:], call.kwargs
