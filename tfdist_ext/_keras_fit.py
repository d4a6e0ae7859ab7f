"""One hook into Keras's ``fit`` for strategies with their own training loop (internal).

Keras 3's TensorFlow trainer has no parameter-server path. ``install()``
wraps ``TensorFlowTrainer.fit`` once; when the model's strategy defines
``_tfdist_fit(model, keras_fit, args, kwargs)`` the call goes there (the
strategy then runs Keras's own loop with its own ``train_function``), and
every other model's ``fit`` is Keras's, untouched.
"""

import functools

_ORIGINAL_FIT = None


def install():
    """Wraps ``TensorFlowTrainer.fit`` once (idempotent)."""
    global _ORIGINAL_FIT
    if _ORIGINAL_FIT is not None:
        return
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.TensorFlowTrainer.fit

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        custom = getattr(self.distribute_strategy, "_tfdist_fit", None)
        if custom is not None:
            return custom(self, original, args, kwargs)
        return original(self, *args, **kwargs)

    _ORIGINAL_FIT = original
    tf_trainer.TensorFlowTrainer.fit = fit
