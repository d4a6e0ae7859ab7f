"""Only the chief writes checkpoints, backups and logs (internal).

Keras's multi-worker guide has the chief write the checkpoints and
TensorBoard logs and every other worker write its copy to a temporary
directory (tf.keras 2's callbacks did this themselves; Keras 3's do not, so
on a shared file system every worker would write the same files at once).
:func:`chief_writes` gives ``fit`` on a worker that is not the chief copies
of the user's ``ModelCheckpoint``, ``TensorBoard`` and ``BackupAndRestore``
callbacks that write under one temporary directory, removed when training
ends (and, after an error, when ``fit`` returns); the user's own callback
objects are left as they are.

The directory goes at ``on_train_end``, before ``fit`` returns, because
TensorFlow's distributed dataset iterator can take many seconds to be
deleted as ``fit`` returns (a ``tf.data`` wait in ``MultiDeviceIterator``'s
teardown, with plain ``tf.distribute.MirroredStrategy`` too): a worker
stopped by its launcher in that window left the directory behind.

``BackupAndRestore`` restores on every worker from the same backup, so a
worker's copy starts from the chief's backup files: as with tf.keras 2,
``backup_dir`` must be a directory every worker reads (a shared file system).
"""

import contextlib
import copy
import os
import shutil
import tempfile

import keras

from tfdist_ext import _owner

_PREFIX = "tfdist-ext-workertemp-"


@contextlib.contextmanager
def chief_writes(strategy, callbacks):
    """Yields the callbacks ``fit`` runs on this worker: ``callbacks`` on the
    chief, copies that write to a temporary directory on any other worker."""
    if strategy.extended.should_checkpoint or not isinstance(callbacks, (list, tuple)):
        yield callbacks
        return
    _remove_orphans()
    task = strategy.cluster_resolver.task_id
    directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{_owner.token()}-{task}-")
    try:
        yield [*(_redirected(c, directory) for c in callbacks), _RemoveAtTrainEnd(directory)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class _RemoveAtTrainEnd(keras.callbacks.Callback):
    """Removes a worker's temporary directory once the callbacks before it have ended."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_end(self, logs=None):
        shutil.rmtree(self.directory, ignore_errors=True)


def _redirected(callback, directory):
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        own = copy.copy(callback)
        own.filepath = os.path.join(directory, "checkpoints", os.path.basename(callback.filepath))
        return own
    if isinstance(callback, keras.callbacks.TensorBoard):
        own = copy.copy(callback)  # set_model gives the copy its own writers
        own.log_dir = os.path.join(directory, "logs")
        return own
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        return _backup_copy(callback, os.path.join(directory, "backup"))
    return callback


def _backup_copy(callback, directory):
    """A copy of ``callback`` that restores the chief's backup and writes to ``directory``."""
    os.makedirs(directory)
    if os.path.isdir(callback.backup_dir):
        for name in os.listdir(callback.backup_dir):
            path = os.path.join(callback.backup_dir, name)
            if os.path.isfile(path):
                shutil.copy2(path, directory)
    own = copy.copy(callback)
    # The public constructor derives every path the callback reads and writes.
    keras.callbacks.BackupAndRestore.__init__(
        own,
        directory,
        save_freq=callback.save_freq,
        double_checkpoint=callback.double_checkpoint,
        delete_checkpoint=callback.delete_checkpoint,
    )
    return own


def _remove_orphans():
    """Removes the temporary directories of workers that were killed (their owner is gone)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if name.startswith(_PREFIX) and not _owner.alive(name[len(_PREFIX) :].split("-", 1)[0]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
