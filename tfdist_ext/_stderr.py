"""Filtering what native code writes to standard error (internal).

TensorFlow's C++ runtime and gRPC log to file descriptor 2, below Python's
``sys.stderr``; the only way to drop a known line is a pipe in front of the
descriptor. Used by the task server (TensorFlow's start-up notices) and by the
parameter-server strategies (expected RPC errors while a cluster closes).
This module imports nothing heavy, so the server can filter TensorFlow's own
import.
"""

import contextlib
import os
import sys
import threading

_GRPC_CONTINUATION = (b":UNKNOWN:", b"This could happen")

# What ``import tensorflow`` writes to file descriptor 2 whatever
# TF_CPP_MIN_LOG_LEVEL says (before absl's logging is initialised).
TF_START_UP_NOISE = (
    b"WARNING: All log messages before absl::InitializeLog() is called",
    b"oneDNN custom operations are on",
)


@contextlib.contextmanager
def native_log_without(patterns):
    """Drops, for the block, the lines written to file descriptor 2 (where
    TensorFlow's C++ runtime logs) that contain one of ``patterns`` (bytes);
    everything else goes through unchanged (a dropped line's gRPC status
    continuation lines are dropped with it)."""
    if not patterns:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def pump():
        dropped = False
        with os.fdopen(read_end, "rb") as lines:
            for line in lines:
                # A gRPC status continues on lines of its own.
                continued = dropped and line.startswith(_GRPC_CONTINUATION)
                dropped = continued or any(p in line for p in patterns)
                if not dropped:
                    os.write(saved, line)

    thread = threading.Thread(target=pump, name="tfdist-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees EOF
        thread.join(timeout=5.0)
        os.close(saved)
