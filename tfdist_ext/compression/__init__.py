"""Gradient compression whose compressed form is what crosses devices and processes.

A compressor is an optax-like pair of pure functions around a small state,
usable inside ``tf.function`` (a strategy, or a Downpour worker pushing to
parameter servers)::

    state = c.init(shape, dtype=tf.float32)       # dict nest of tensors
    wire, state = c.compress(grad, state, step)   # wire: dict of int32/float32 tensors
    grad = c.decompress(wire, shape, dtype)       # receiver side
    total = c.aggregate([wire_a, wire_b], shape)  # sum over senders (majority vote for SignSGD)
    c.wire_bytes(wire)                            # int64 tensor: bytes that travel

Error feedback is a wrapper: ``ErrorFeedback(TopK(0.01))``. Wire forms are
packed into ``int32``/``float32`` tensors only (bit planes 32 per word, half
floats 2 per word), the dtypes every collective supports.

Example:
  >>> import tfdist_ext
  >>> from tfdist_ext import compression
  >>> strategy = tfdist_ext.CompressedMirroredStrategy(   # doctest: +SKIP
  ...     devices=["/cpu:0", "/cpu:1"],
  ...     compression=compression.DGC(sparsity=0.999, steps_per_epoch=50))
"""

from tfdist_ext.compression._backup import CompressedBackupAndRestore
from tfdist_ext.compression._base import Compressor
from tfdist_ext.compression._base import ErrorFeedback
from tfdist_ext.compression._compressors import BF16
from tfdist_ext.compression._compressors import DGC
from tfdist_ext.compression._compressors import EFSignSGD
from tfdist_ext.compression._compressors import FP16
from tfdist_ext.compression._compressors import NoCompression
from tfdist_ext.compression._compressors import OneBit
from tfdist_ext.compression._compressors import PowerSGD
from tfdist_ext.compression._compressors import QSGD
from tfdist_ext.compression._compressors import RandomK
from tfdist_ext.compression._compressors import ScaledSign
from tfdist_ext.compression._compressors import SignSGD
from tfdist_ext.compression._compressors import TernGrad
from tfdist_ext.compression._compressors import Threshold
from tfdist_ext.compression._compressors import TopK
from tfdist_ext.compression._registry import get
from tfdist_ext.compression._strategy import CompressedMirroredStrategy
from tfdist_ext.compression._strategy import CompressedMultiWorkerMirroredStrategy
from tfdist_ext.compression._strategy import CompressionState
from tfdist_ext.compression._strategy import MirroredStrategy
from tfdist_ext.compression._strategy import MultiWorkerMirroredStrategy


def __getattr__(name):
    # Lazy: the callback lives in tfdist_ext.callbacks (another package).
    if name == "CompressionLogger":
        from tfdist_ext.callbacks import _compression

        return getattr(_compression, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BF16",
    "CompressedBackupAndRestore",
    "CompressionLogger",
    "CompressedMirroredStrategy",
    "CompressedMultiWorkerMirroredStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "CompressionState",
    "Compressor",
    "DGC",
    "EFSignSGD",
    "ErrorFeedback",
    "FP16",
    "NoCompression",
    "OneBit",
    "PowerSGD",
    "QSGD",
    "RandomK",
    "ScaledSign",
    "SignSGD",
    "TernGrad",
    "Threshold",
    "TopK",
    "get",
]
