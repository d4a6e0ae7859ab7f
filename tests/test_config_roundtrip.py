"""Configurations read back: every exported compressor through Keras's
serialisation and its lookup name, every strategy's ``get_config`` through its
``from_config``.

No cluster: the parameter-server strategies connect to theirs when they are
constructed, so their config path is tested on its own (a strategy object
with its knobs set as the constructor sets them, and a constructor that
records what ``from_config`` gives it).
"""

import inspect
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist_ext
from tfdist_ext import compression as C
from tfdist_ext._ps_strategy import ParameterServerBase
from tfdist_ext.downpour import DelayCompensation
from tfdist_ext.downpour import DownpourStrategy
from tfdist_ext.downpour import ElasticAveragingStrategy
from tfdist_ext.downpour import StalenessAwareLR
from tfdist_ext.sandblaster import SandblasterStrategy

pytestmark = pytest.mark.timeout(120)

# Every exported compressor class, with configurations away from its defaults
# (and wrapped ones nested).
EXAMPLES = {
    "NoCompression": [C.NoCompression()],
    "FP16": [C.FP16()],
    "BF16": [C.BF16()],
    "TopK": [C.TopK(0.05)],
    "RandomK": [C.RandomK(0.1, seed=3)],
    "Threshold": [C.Threshold(0.01)],
    "DGC": [
        C.DGC(
            sparsity=0.99,
            momentum=0.8,
            clip_norm=2.0,
            warmup_epochs=2,
            steps_per_epoch=10,
            momentum_correction=False,
            min_size=64,
        ),
        C.DGC(warmup_epochs=0),
    ],
    "QSGD": [C.QSGD(levels=8, seed=2)],
    "TernGrad": [C.TernGrad(seed=5)],
    "SignSGD": [C.SignSGD()],
    "ScaledSign": [C.ScaledSign()],
    "EFSignSGD": [C.EFSignSGD(), C.EFSignSGD(min_size=8), C.EFSignSGD(C.TopK(0.1), min_size=8)],
    "OneBit": [C.OneBit(), C.OneBit(min_size=16), C.OneBit(C.ScaledSign())],
    "PowerSGD": [C.PowerSGD(rank=3, seed=1)],
    "ErrorFeedback": [
        C.ErrorFeedback(C.TopK(0.01)),
        C.ErrorFeedback(C.DGC(warmup_epochs=0), min_size=32),
        C.ErrorFeedback(C.ErrorFeedback(C.RandomK(0.2, seed=1))),
    ],
}
COMPRESSORS = [c for examples in EXAMPLES.values() for c in examples]


def _exported_compressor_classes():
    classes = {name: getattr(C, name) for name in C.__all__}
    return {
        name: cls
        for name, cls in classes.items()
        if isinstance(cls, type) and issubclass(cls, C.Compressor) and cls is not C.Compressor
    }


def test_every_exported_compressor_has_a_case():
    assert set(EXAMPLES) == set(_exported_compressor_classes())
    for name, examples in EXAMPLES.items():
        assert all(type(c) is getattr(C, name) for c in examples), name


def _serialised(c):
    return keras.saving.serialize_keras_object(c)


@pytest.mark.parametrize("c", COMPRESSORS, ids=repr)
def test_compressor_roundtrips_through_keras_serialisation_and_json(c):
    stored = json.loads(json.dumps(_serialised(c)))  # plain data
    again = keras.saving.deserialize_keras_object(stored)
    assert type(again) is type(c)
    assert _serialised(again) == _serialised(c) and repr(again) == repr(c)
    # Keras's own protocol, without the registry.
    direct = type(c).from_config(c.get_config())
    assert _serialised(direct) == _serialised(c)
    # The configuration is complete: the rebuilt compressor sends the same wire.
    grad = tf.constant(np.random.default_rng(0).normal(size=(40, 25)).astype(np.float32))
    np.testing.assert_array_equal(again.roundtrip(grad)[0], c.roundtrip(grad)[0])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_exported_compressor_is_reachable_by_its_lookup_name(name):
    cls = getattr(C, name)
    c = EXAMPLES[name][0]
    assert type(C.get(c.name)) is cls, c.name
    assert C.get(c.name).name == c.name


def test_scaled_sign_is_looked_up():
    assert type(C.get("scaledsign")) is C.ScaledSign
    assert type(C.get("ScaledSign")) is C.ScaledSign
    assert type(C.get("ef_scaledsign").compressor) is C.ScaledSign


# -- strategies ------------------------------------------------------------------

STRATEGIES = [
    (
        DownpourStrategy,
        dict(
            n_fetch=5,
            n_push=3,
            warmstart_steps=20,
            min_shard_bytes=1 << 20,
            deadline=30.0,
            compression=C.ErrorFeedback(C.TopK(0.01)),
            model_devices=["/device:CPU:0", "/device:CPU:1"],
            staleness_policy=StalenessAwareLR(),
            max_staleness=2,
            background_fetch=True,
        ),
    ),
    (
        DownpourStrategy,
        dict(
            n_fetch=1,
            n_push=1,
            warmstart_steps=0,
            min_shard_bytes=256 << 10,
            deadline=60.0,
            compression=None,
            model_devices=None,
            staleness_policy=DelayCompensation(lam=0.5),
            max_staleness=None,
            background_fetch=False,
        ),
    ),
    (
        DownpourStrategy,
        dict(
            n_fetch=2,
            n_push=2,
            warmstart_steps=0,
            min_shard_bytes=256 << 10,
            deadline=60.0,
            compression=C.DGC(sparsity=0.99, warmup_epochs=0, min_size=128),
            model_devices=None,
            staleness_policy=None,
            max_staleness=0,
            background_fetch=True,
        ),
    ),
    (
        ElasticAveragingStrategy,
        dict(alpha=0.45, tau=4, min_shard_bytes=1 << 20, deadline=30.0),
    ),
    (
        SandblasterStrategy,
        dict(
            slices_per_worker=4,
            backup_tasks=False,
            max_copies=3,
            min_shard_bytes=1 << 20,
            deadline=20.0,
        ),
    ),
]


def _configured(cls, knobs):
    """A ``cls`` with ``knobs`` set as its constructor sets them, without its cluster."""
    strategy = cls.__new__(cls)
    for name, value in knobs.items():
        setattr(strategy, name, value)
    return strategy


def _comparable(value):
    return _serialised(value) if isinstance(value, C.Compressor) else value


def test_every_exported_strategy_with_a_config_has_a_case():
    exported = {getattr(tfdist_ext, name) for name in tfdist_ext.__all__}
    strategies = {
        s for s in exported if isinstance(s, type) and issubclass(s, tf.distribute.Strategy)
    }
    with_config = {s for s in strategies if callable(getattr(s, "get_config", None))}
    assert with_config == {cls for cls, _ in STRATEGIES}
    assert all(issubclass(cls, ParameterServerBase) for cls in with_config)


@pytest.mark.parametrize(
    "cls,knobs", STRATEGIES, ids=[f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(STRATEGIES)]
)
def test_strategy_config_roundtrips_through_from_config(cls, knobs, monkeypatch):
    config = _configured(cls, knobs).get_config()
    # Every keyword of the constructor, nothing else (the cluster is not a knob).
    keywords = set(inspect.signature(cls.__init__).parameters) - {"self", "cluster_resolver"}
    assert set(config) == keywords
    stored = json.loads(json.dumps(config))  # plain data, JSON and back
    assert stored == config

    made = []

    def constructor(self, cluster_resolver, **kwargs):
        made.append((cluster_resolver, kwargs))

    monkeypatch.setattr(cls, "__init__", constructor)
    resolver = object()
    again = cls.from_config(stored, resolver)
    assert type(again) is cls
    [(given, kwargs)] = made
    assert given is resolver
    assert {k: _comparable(v) for k, v in kwargs.items()} == {
        k: _comparable(v) for k, v in knobs.items()
    }
    assert all(
        type(kwargs[k]) is type(v) for k, v in knobs.items()
    )  # compressors and policies rebuilt, not left as dicts
    # The rebuilt knobs give the same configuration again.
    assert _configured(cls, kwargs).get_config() == config
