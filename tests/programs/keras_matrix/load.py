"""Loads the matrix's saved models in a fresh process without tfdist_ext.

``python load.py OUT KINDS``: loads ``OUT/KIND.keras`` for each kind (the
user's own ``user_models`` beside this script registers their classes),
predicts the saved probe inputs and prints ``RESULT <json>``: per kind the
largest difference from the training process's predictions, and whether
tfdist_ext was imported.
"""

import json
import sys

import keras
import numpy as np
import user_models  # noqa: F401 - registers the user's classes


def load(out, kind):
    """The largest prediction difference of one kind's saved model."""
    saved = np.load(f"{out}/{kind}.npz")
    probe = [saved[f"arr_{i}"] for i in range(len(saved.files) - 1)]
    result = {}
    try:
        model = keras.models.load_model(f"{out}/{kind}.keras")
    except Exception as e:  # e.g. an optimizer class this process does not have
        result["compile_error"] = f"{type(e).__name__}: {e}"[:2000]
        model = keras.models.load_model(f"{out}/{kind}.keras", compile=False)
    predictions = model.predict(probe if len(probe) > 1 else probe[0], verbose=0)
    difference = predictions.astype("float32") - saved["predictions"].astype("float32")
    result["max_diff"] = float(np.max(np.abs(difference)))
    return result


def main(out, kinds):
    results = {}
    for kind in kinds.split(","):
        try:
            results[kind] = load(out, kind)
        except Exception as e:  # noqa: BLE001 - reported per kind
            results[kind] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    results["imported_tfdist_ext"] = "tfdist_ext" in sys.modules
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
