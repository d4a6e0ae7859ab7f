"""EASGD's replicas in Keras's ``BackupAndRestore`` (internal).

Between rounds each worker's replica, its copy of the optimizer's state and
its steps since its last exchange live on the ``ps`` tasks
(``_elastic._Replicas``), not in the model, so Keras's callback does not see
them. :class:`ReplicaState` is what ``ElasticAveragingStrategy._backup_state``
gives ``tfdist_ext._state_backup``'s callback: it writes the rows to
``backup_dir/easgd_replicas/replicas.npz`` where Keras writes the model, and
on resume hands them to the model's next round, whose workers continue their
replicas instead of restarting from the centre.
"""

import os

import numpy as np

# A row's generation when it came from a backup: the worker's next round
# continues it whatever the current generation (``_elastic._Replicas.load``).
RESTORED = -2
# A row no worker has written: the worker starts afresh from the centre.
_EMPTY = -1


class ReplicaState:
    """The replicas of one model in a backup directory."""

    name = "easgd_replicas"
    _FILE = "replicas.npz"

    def __init__(self, strategy, model):
        self.strategy, self.model = strategy, model

    def check(self, directory):
        """Whether ``directory`` holds replicas (what they must fit is checked
        when the model's round takes them: :func:`fitted`)."""
        return os.path.exists(os.path.join(directory, self._FILE))

    def save(self, directory):
        replicas = self.strategy._replicas_of(self.model)
        if replicas is None:  # no round has run: nothing beside the model yet
            return
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self._FILE)
        # Written whole or not at all: a preemption mid-write leaves the last one.
        partial = os.path.join(directory, "partial.npz")
        np.savez(partial, **replicas.snapshot())
        os.replace(partial, path)

    def restore(self, directory):
        with np.load(os.path.join(directory, self._FILE)) as saved:
            arrays = {key: saved[key] for key in saved.files}
        self.strategy._restore_replicas(self.model, arrays)


def fitted(arrays, kept, workers):
    """``(rows, since, born)`` for ``workers`` workers from a backup's arrays
    (``_Replicas.snapshot``); ``kept`` are the variables the rows copy. A
    backup of another model or optimizer is refused, naming what differs."""
    saved = sorted((k for k in arrays if k.startswith("row_")), key=lambda k: int(k[4:]))
    if len(saved) != len(kept):
        raise ValueError(
            f"ElasticAveragingStrategy: the backup holds replicas of {len(saved)} "
            f"variables (weights and optimizer state), this model and optimizer have "
            f"{len(kept)}; resume with the model and optimizer the backup was made with, "
            "or give a new backup_dir to start afresh"
        )
    shared = min(workers, len(arrays["since"]))
    rows = []
    for key, variable in zip(saved, kept):
        value = arrays[key]
        if tuple(value.shape[1:]) != tuple(variable.shape):
            raise ValueError(
                f"ElasticAveragingStrategy: the backup's replica of {variable.path!r} has "
                f"shape {tuple(value.shape[1:])}, this model's {tuple(variable.shape)}; "
                "resume with the model the backup was made with, or give a new backup_dir"
            )
        row = np.zeros((workers, *variable.shape), value.dtype)
        row[:shared] = value[:shared]
        rows.append(row)
    since = np.zeros(workers, np.int64)
    since[:shared] = arrays["since"][:shared]
    born = np.full(workers, _EMPTY, np.int64)
    born[:shared] = np.where(arrays["valid"][:shared], RESTORED, _EMPTY)
    return rows, since, born
