"""Compressors by name (internal): ``tfdist_ext.compression.get``."""

import keras

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

_NAMES = {
    "none": NoCompression,
    "fp16": FP16,
    "bf16": BF16,
    "topk": TopK,
    "randomk": RandomK,
    "threshold": Threshold,
    "dgc": DGC,
    "qsgd": QSGD,
    "terngrad": TernGrad,
    "onebit": OneBit,
    "signsgd": SignSGD,
    "scaledsign": ScaledSign,
    "efsignsgd": EFSignSGD,
    "powersgd": PowerSGD,
}


def get(identifier: str | dict | Compressor, **kwargs) -> Compressor:
    """A compressor from a name (``"fp16"``, ``"topk"``, ...), a config dict, or itself.

    Keyword arguments go to the constructor. ``"ef_<name>"`` wraps the named
    compressor in :class:`ErrorFeedback`.

    Example:
      >>> get("topk", ratio=0.01)
      TopK(ratio=0.01)
      >>> get("ef_randomk", ratio=0.05)
      ErrorFeedback(RandomK(ratio=0.05, seed=0))
    """
    if isinstance(identifier, Compressor):
        return identifier
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if isinstance(identifier, str):
        key = identifier.lower()
        if key.startswith("ef_") and key[3:] in _NAMES:
            return ErrorFeedback(_NAMES[key[3:]](**kwargs))
        if key in _NAMES:
            return _NAMES[key](**kwargs)
    raise ValueError(
        f"compression.get: unknown compressor {identifier!r}; expected a Compressor, "
        f"a config dict or one of {sorted(_NAMES)} (optionally prefixed 'ef_')"
    )
