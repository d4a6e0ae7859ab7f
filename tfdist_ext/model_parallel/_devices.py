"""Forcing where variables and ops go (internal): the one primitive the
model-parallel layers, the planner's placement and the strategy share."""

import contextlib
import threading

import tensorflow as tf

_LOCAL = threading.local()


@contextlib.contextmanager
def forced_device(device):
    """Variables created inside go to ``device`` even under a strategy scope."""
    previous = getattr(_LOCAL, "device", None)
    _LOCAL.device = device
    try:
        yield
    finally:
        _LOCAL.device = previous


def current_forced_device():
    return getattr(_LOCAL, "device", None)


@contextlib.contextmanager
def on_device(device):
    """``tf.device(device)`` that also forces variable placement; no-op for ``None``."""
    if device is None:
        yield
        return
    with forced_device(device), tf.device(device):
        yield
