"""Loads a saved Keras model as a user without tfdist_ext would:
``python -m tests.programs.load_keras_model MODEL INPUTS``.

Imports Keras and NumPy only. Prints the model's optimizer class, its first
layer's compute dtype, and its predictions for INPUTS (a ``.npy`` file).
"""

import sys

import keras
import numpy as np

from tests.programs import report


def main(path, inputs):
    model = keras.models.load_model(path)
    x = np.load(inputs)
    report(
        [
            type(model.optimizer).__name__,
            model.layers[0].compute_dtype,
            model.predict(x, verbose=0).tolist(),
        ]
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
