"""tfdist_ext where an optional dependency is not installed: ``python -m
tests.programs.packaging_cases CASE [ARGS]``.

A package is made unimportable (``sys.modules[name] = None``, as if it were
not installed) before tfdist_ext is imported, so this module imports
neither at the top. Each case reports the ImportError's message for
``tests/test_packaging.py``.
"""

import sys

from tests.programs import report

#: Calls that need an optional package, by name: the data sets of the extras.
CALLS = {
    "digits": lambda datasets: datasets.digits("train", as_numpy=True),
    "mnist1d": lambda datasets: datasets.mnist1d("train", as_numpy=True),
    "from_tfds": lambda datasets: datasets.from_tfds("mnist", data_dir="/nonexistent"),
}


def without_tensorflow():
    """``import tfdist_ext`` as if TensorFlow were not installed."""
    sys.modules["tensorflow"] = None
    try:
        import tfdist_ext  # noqa: F401 - what is tested
    except ImportError as e:
        report({"import_error": str(e)})
    else:
        sys.exit("tfdist_ext imported without TensorFlow")


def data_set_without(blocked, call):
    """``CALLS[call]`` as if package ``blocked`` were not installed."""
    sys.modules[blocked] = None
    from tfdist_ext import datasets

    try:
        CALLS[call](datasets)
    except ImportError as e:
        report({"import_error": str(e)})
    else:
        sys.exit(f"loaded without {blocked}")


CASES = {fn.__name__: fn for fn in (without_tensorflow, data_set_without)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
