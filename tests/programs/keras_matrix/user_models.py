"""The user's models, as Keras's guides write them (no tfdist_ext here)."""

import keras
import tensorflow as tf

CALLS = {"layer": 0, "model": 0}


def sequential():
    """ "The Sequential model": a small CNN on 8x8 images."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )


def functional_two_inputs():
    """ "The Functional API": two inputs (top and bottom half of an image)."""
    top = keras.Input((32,), name="top")
    bottom = keras.Input((32,), name="bottom")
    features = keras.layers.concatenate(
        [
            keras.layers.Dense(16, activation="relu")(top),
            keras.layers.Dense(16, activation="relu")(bottom),
        ]
    )
    return keras.Model([top, bottom], keras.layers.Dense(10)(features))


@keras.saving.register_keras_serializable(package="user_models")
class Linear(keras.layers.Layer):
    """ "Making new layers and models via subclassing": weights made in build()."""

    def __init__(self, units=32, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(
            shape=(input_shape[-1], self.units), initializer="random_normal", trainable=True
        )
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

    def call(self, inputs):
        CALLS["layer"] += 1
        return keras.ops.matmul(inputs, self.w) + self.b

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="user_models")
class ActivityRegularizationLayer(keras.layers.Layer):
    """The same guide: a layer that adds a loss in call()."""

    def __init__(self, rate=1e-2, **kwargs):
        super().__init__(**kwargs)
        self.rate = rate

    def call(self, inputs):
        self.add_loss(self.rate * keras.ops.mean(inputs))
        return inputs

    def get_config(self):
        return {**super().get_config(), "rate": self.rate}


@keras.saving.register_keras_serializable(package="user_models")
class MLP(keras.Model):
    """The same guide: a model subclass built on the user's layers."""

    def __init__(self, units=32, num_classes=10, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.num_classes = num_classes
        self.hidden = Linear(units)
        self.regularization = ActivityRegularizationLayer()
        self.classifier = keras.layers.Dense(num_classes)

    def call(self, inputs):
        CALLS["model"] += 1
        return self.classifier(self.regularization(keras.ops.relu(self.hidden(inputs))))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "num_classes": self.num_classes}


def subclassed():
    return MLP()


@keras.saving.register_keras_serializable(package="user_models")
class CustomStepModel(keras.Model):
    """ "Customizing what happens in fit()": the guide's own train_step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.user_steps = keras.metrics.Sum(name="user_steps")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:
            if metric is self.user_steps:
                metric.update_state(1.0)
            elif metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step():
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    return CustomStepModel(inputs, keras.layers.Dense(10)(hidden))


def bn_dropout():
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(32),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.2),
            keras.layers.Dense(10),
        ]
    )


def embedding():
    """A tiny sequence model on integer tokens."""
    return keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ]
    )


def mixed_precision():
    """ "Mixed precision": build under the global policy, float32 outputs."""
    inputs = keras.Input((64,))
    x = keras.layers.Dense(32, activation="relu")(inputs)
    x = keras.layers.Dense(10)(x)
    return keras.Model(inputs, keras.layers.Activation("linear", dtype="float32")(x))


mixed_float16 = mixed_bfloat16 = mixed_precision


def checkpoint_restart():
    """ "Multi-GPU distributed training with TensorFlow": the guide's functional model
    (trained with ModelCheckpoint, then restored under the scope and continued)."""
    inputs = keras.Input((64,))
    x = keras.layers.Dense(256, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))
