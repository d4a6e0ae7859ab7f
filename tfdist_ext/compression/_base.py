"""The compressor protocol and error-feedback memory (internal).

A compressor is a pure, optax-like pair of functions around a small state::

    state = c.init(shape, dtype)                 # nest of tensors (zeros)
    wire, state = c.compress(grad, state, step)  # wire: dict of int32/float32 tensors
    grad = c.decompress(wire, shape, dtype)      # dense tensor again
    total = c.aggregate([wire_0, ..., wire_n], shape, dtype)   # sum over senders
    c.wire_bytes(wire)                           # int64 tensor

``compress`` runs on the sender, ``decompress``/``aggregate`` on the receiver;
only ``wire`` travels. All of it works inside ``tf.function``.
"""

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfdist_ext.compression import _wire

FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

# The protocol's types: a gradient's shape, a state or wire form (a dict of
# tensors, nested for wrapped compressors), a step or epoch counter.
Shape = Sequence[int] | tf.TensorShape
Tensors = dict[str, Any]
DType = tf.dtypes.DType | str
Counter = int | tf.Tensor


def check_ratio(owner, name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{owner}: {name} must be a number in (0, 1], got {value!r}")
    return float(value)


def check_positive(owner, name, value, *, integer=False, allow_zero=False):
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    low_ok = ok_type and (value >= 0 if allow_zero else value > 0)
    if isinstance(value, bool) or not ok_type or not low_ok:
        kind = "an integer" if integer else "a number"
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}: {name} must be {kind} {bound}, got {value!r}")
    return value


class Compressor:
    """Base class of gradient compressors (see module docstring for the protocol).

    Subclasses implement :meth:`compress` and :meth:`decompress`, and
    :meth:`init` when they keep state.

    Two flags tell a strategy what a compressor needs from it:
    ``follows_epochs`` (``compress`` takes ``epoch=``, the 0-based epoch of
    ``model.fit``: DGC's warm-up without ``steps_per_epoch``) and
    ``applies_momentum`` (the sender applies momentum itself, so an optimizer
    with momentum would apply it twice: DGC's momentum correction).

    Example:
      >>> from tfdist_ext.compression import TopK
      >>> c = TopK(0.01)
      >>> state = c.init((1000,))
      >>> wire, state = c.compress(tf.random.normal([1000]), state, step=0)
      >>> g = c.decompress(wire, (1000,))
    """

    name = "compressor"
    follows_epochs = False
    applies_momentum = False

    def init(self, shape: Shape, dtype: DType = tf.float32) -> Tensors:
        """Returns the initial state (a dict of tensors) for a gradient of ``shape``."""
        self.check_dtype(dtype)
        return {}

    def check_dtype(self, dtype: DType) -> tf.dtypes.DType:
        """Returns ``dtype`` as a ``tf.DType``; raises ``ValueError`` if it is not a float type."""
        dtype = tf.as_dtype(dtype)
        if dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: unsupported gradient dtype {dtype.name}; "
                f"compressors take floating-point gradients "
                f"({', '.join(d.name for d in FLOAT_DTYPES)})"
            )
        return dtype

    def compress(self, grad: tf.Tensor, state: Tensors, step: Counter) -> tuple[Tensors, Tensors]:
        """Returns ``(wire, new_state)`` for ``grad`` (sender side)."""
        raise NotImplementedError

    def decompress(self, wire: Tensors, shape: Shape, dtype: DType = tf.float32) -> tf.Tensor:
        """The dense gradient a ``wire`` stands for (receiver side)."""
        raise NotImplementedError

    def aggregate(
        self, wires: Sequence[Tensors], shape: Shape, dtype: DType = tf.float32
    ) -> tf.Tensor:
        """Sum over senders of the decompressed wires (receiver side)."""
        total = self.decompress(wires[0], shape, dtype)
        for w in wires[1:]:
            total += self.decompress(w, shape, dtype)
        return total

    def wire_bytes(self, wire: Tensors) -> tf.Tensor:
        """Bytes the wire form occupies (int64 tensor)."""
        return _wire.wire_bytes(wire)

    def roundtrip(
        self, grad: tf.Tensor, state: Tensors | None = None, step: Counter = 0
    ) -> tuple[tf.Tensor, Tensors]:
        """``decompress(compress(grad))``: what a receiver reconstructs; returns ``(grad, state)``."""
        grad = tf.convert_to_tensor(grad)
        if state is None:
            state = self.init(grad.shape, grad.dtype)
        wire, state = self.compress(grad, state, step)
        return self.decompress(wire, grad.shape, grad.dtype), state

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)

    def __repr__(self):
        args = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items() if not isinstance(v, dict)
        )
        return f"{type(self).__name__}({args})"


def _flat32(grad):
    return tf.reshape(tf.cast(grad, tf.float32), [-1])


def _restore(flat, shape, dtype):
    return tf.cast(tf.reshape(flat, shape), dtype)


@keras.saving.register_keras_serializable(package="tfdist_ext")
class ErrorFeedback(Compressor):
    """Error-feedback memory around any compressor (Seide et al. 2014; Karimireddy et al. 2019).

    Each sender adds what it failed to send last time to the new gradient,
    compresses the sum, and keeps ``corrected - decompress(wire)`` as its new
    residual. The residual is per sender (per replica) state.

    Tensors with fewer than ``min_size`` elements (biases, normalisation
    parameters, a small output layer) skip the compressor and the memory and
    are sent dense, as DGC's reference implementation does: compressing a
    32-entry bias to one entry per step delays most of it by tens of steps.
    The bytes they cost are counted like any other wire bytes.

    Args:
      compressor: the compressor applied to ``gradient + residual``.
      min_size: tensors with fewer elements are sent dense (0: compress all).

    Example:
      >>> from tfdist_ext.compression import ErrorFeedback, TopK
      >>> ef = ErrorFeedback(TopK(0.01))
      >>> ErrorFeedback(TopK(0.01), min_size=1024).is_dense((64,))
      True
      >>> state = ef.init((1000,))
      >>> wire, state = ef.compress(tf.random.normal([1000]), state, step=0)
      >>> state["residual"].shape
      TensorShape([1000])
    """

    def __init__(self, compressor: Compressor | dict, min_size: int = 0):
        if isinstance(compressor, dict):
            compressor = keras.saving.deserialize_keras_object(compressor)
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"ErrorFeedback: compressor must be a tfdist_ext.compression."
                f"Compressor, got {compressor!r}"
            )
        self.compressor = compressor
        self.min_size = check_positive(
            type(self).__name__, "min_size", min_size, integer=True, allow_zero=True
        )
        self.name = f"ef_{compressor.name}"

    def is_dense(self, shape: Shape) -> bool:
        """True when a gradient of ``shape`` has fewer than ``min_size`` elements (sent dense)."""
        return _wire.static_num_elements(shape) < self.min_size

    @property
    def follows_epochs(self):
        return self.compressor.follows_epochs

    @property
    def applies_momentum(self):
        return self.compressor.applies_momentum

    def init(self, shape, dtype=tf.float32):
        self.check_dtype(dtype)
        if self.is_dense(shape):
            return {}
        return {
            "residual": tf.zeros(shape, tf.float32),
            "inner": self.compressor.init(shape, dtype),
        }

    def compress(self, grad, state, step, epoch=None):
        if self.is_dense(grad.shape):
            return {"values": _flat32(grad)}, state
        corrected = tf.cast(grad, tf.float32) + state["residual"]
        clock = {"epoch": epoch} if self.follows_epochs else {}
        wire, inner = self.compressor.compress(corrected, state["inner"], step, **clock)
        sent = self.compressor.decompress(wire, corrected.shape, tf.float32)
        return wire, {"residual": corrected - sent, "inner": inner}

    def decompress(self, wire, shape, dtype=tf.float32):
        if self.is_dense(shape):
            return _restore(wire["values"], shape, dtype)
        return self.compressor.decompress(wire, shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        if self.is_dense(shape):
            return _restore(tf.add_n([w["values"] for w in wires]), shape, dtype)
        return self.compressor.aggregate(wires, shape, dtype)

    def get_config(self):
        config = {"compressor": keras.saving.serialize_keras_object(self.compressor)}
        if self.min_size:
            config["min_size"] = self.min_size
        return config

    def __repr__(self):
        extra = f", min_size={self.min_size}" if self.min_size else ""
        return f"ErrorFeedback({self.compressor!r}{extra})"
