"""What a killed process leaves is removed by the next one, and only that.

A worker's temporary directory (Keras's "only the chief writes" convention)
is named after its owner; the next worker removes those whose owner is gone.
Pids wrap and ``/proc/<n>`` also answers for a thread's id, so a directory
whose pid now belongs to another process or thread must still be removed.
"""

import os
import subprocess
import sys
import tempfile
import threading
from types import SimpleNamespace

import pytest

from tfdist_ext import _owner
from tfdist_ext.compression import _worker_files


def _dead_token():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    token = _owner.token(proc.pid)
    proc.communicate(b"", timeout=30)
    return token


def test_token_names_this_process_only_while_it_runs():
    assert _owner.alive(_owner.token())
    assert not _owner.alive(_dead_token())
    pid = os.getpid()
    assert not _owner.alive(f"{pid}.{int(_owner.token().split('.')[1]) + 1}")  # pid reused
    for bad in ("", "x", "12.y", "-3"):
        assert not _owner.alive(bad), bad


@pytest.mark.timeout(60)
def test_next_worker_removes_dirs_of_dead_owners_even_if_their_pid_is_reused(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        # A thread now holds the number a killed worker had: same pid, later start.
        reused = f"{thread.native_id}.1"
        names = {
            "dead": f"{_worker_files._PREFIX}{_dead_token()}-1-abc",
            "reused": f"{_worker_files._PREFIX}{reused}-1-def",
            "live": f"{_worker_files._PREFIX}{_owner.token()}-2-ghi",
            "other": "someone-elses-dir",
        }
        for name in names.values():
            os.makedirs(tmp_path / name / "backup")
        _worker_files._remove_orphans()
    finally:
        stop.set()
        thread.join()
    assert sorted(os.listdir(tmp_path)) == sorted([names["live"], names["other"]])


def test_worker_directory_goes_when_training_ends_before_fit_returns(monkeypatch, tmp_path):
    # TensorFlow's distributed iterator can take seconds to be deleted as
    # fit returns; a worker stopped then must not leave its directory.
    import keras

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    worker = SimpleNamespace(
        extended=SimpleNamespace(should_checkpoint=False),
        cluster_resolver=SimpleNamespace(task_id=1),
    )
    user = keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"))
    with _worker_files.chief_writes(worker, [user]) as callbacks:
        (directory,) = os.listdir(tmp_path)
        assert callbacks[0] is not user
        assert callbacks[0].filepath.startswith(str(tmp_path / directory))
        for callback in callbacks:
            callback.on_train_end()
        assert os.listdir(tmp_path) == []
