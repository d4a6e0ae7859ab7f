"""A saved model's optimizer, loaded in a fresh process: ``python -m
tests.programs.saved_optimizers CASE PATH``.

What a process has imported when it loads is what the tests check (Keras
finds a registered optimizer only once its module has run), so this module
imports nothing of Keras or tfdist_ext at the top: each case imports what
its user's script would, and nothing else.
"""

import sys

from tests.programs import report


def save_lbfgs(path):
    """Saves a model compiled with LBFGS to ``path``, its predictions to ``path.npy``."""
    import keras
    import numpy as np

    import tfdist_ext

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=4), loss="mse")
    model.save(path)
    np.save(path + ".npy", model.predict(np.ones((2, 3), "float32"), verbose=0))
    report({"saved": path})


def load_lbfgs(path):
    """Loads ``path`` compiled, as a user's script that imports keras and tfdist_ext
    (nothing of tfdist_ext's submodules)."""
    import keras
    import numpy as np

    import tfdist_ext  # noqa: F401 - what registers the optimizer

    model = keras.models.load_model(path)
    report(
        {
            "optimizer": type(model.optimizer).__name__,
            "memory": model.optimizer.memory,
            "predicted": model.predict(np.ones((2, 3), "float32"), verbose=0).tolist(),
            "saved": np.load(path + ".npy").tolist(),
        }
    )


def load_with_optimizers(path):
    """Loads ``path`` after ``import tfdist_ext.optimizers``; the optimizer's class name."""
    import keras

    import tfdist_ext.optimizers  # noqa: F401 - what registers the optimizer

    report({"optimizer": type(keras.models.load_model(path).optimizer).__name__})


def load_with_keras_alone(path):
    """Loads ``path`` with Keras alone (fails when its optimizer is tfdist_ext's)."""
    import keras

    report({"optimizer": type(keras.models.load_model(path).optimizer).__name__})


CASES = {
    fn.__name__: fn for fn in (save_lbfgs, load_lbfgs, load_with_optimizers, load_with_keras_alone)
}


def main(argv):
    """``CASE PATH``: runs the case of that name on PATH."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
