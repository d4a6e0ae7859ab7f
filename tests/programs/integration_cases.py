"""A Keras or TensorFlow release that changed an internal tfdist_ext relies on,
simulated, then a strategy loaded: ``python -m tests.programs.integration_cases
CASE [ARGS]``.

Each case changes the internal before anything of tfdist_ext is imported (this
module imports neither at the top), then reports the ImportError loading a
strategy raised, for ``tests/test_integration.py`` to check.
"""

import importlib
import sys

from tests.programs import report


def load_strategy():
    """Loads a strategy; reports the ImportError's message, or None."""
    import tfdist_ext  # light: TensorFlow-backed parts load on first use

    try:
        loaded = tfdist_ext.DownpourStrategy
    except ImportError as e:
        report({"import_error": str(e)})
    else:
        report({"import_error": None, "loaded": loaded.__name__})


def removed(dotted):
    """``package.OWNER.attribute`` deleted (OWNER a class, or a module), as a
    release that renamed it."""
    module, cls, attr = dotted.rsplit(".", 2)
    owner = getattr(importlib.import_module(module), cls)
    for klass in getattr(owner, "__mro__", (owner,)):  # a class, or a module
        if attr in vars(klass):
            delattr(klass, attr)
    load_strategy()


def rewritten(module, cls, name):
    """``module.cls.name`` replaced by a method that calls it, with source of its
    own: as a release whose method no longer sets (or contains) what the package
    reads."""
    import keras  # noqa: F401 - loaded before the change, as a user's script does

    owner = getattr(importlib.import_module(module), cls)
    original = getattr(owner, name)

    def method(self, *args, **kwargs):
        return original(self, *args, **kwargs)

    method.__module__, method.__qualname__ = original.__module__, original.__qualname__
    setattr(owner, name, method)
    load_strategy()


def unregister_sharded():
    """ShardedVariable's conversion to one tensor taken out of TensorFlow's registry."""
    import keras  # noqa: F401 - loaded before the change, as a user's script does
    from tensorflow.python.distribute.sharded_variable import ShardedVariable
    from tensorflow.python.framework import tensor_conversion_registry as registry

    for funcs in registry._tensor_conversion_func_registry.values():
        funcs[:] = [(base, f) for base, f in funcs if base is not ShardedVariable]
    registry._tensor_conversion_func_cache.clear()
    load_strategy()


CASES = {fn.__name__: fn for fn in (removed, rewritten, unregister_sharded)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
