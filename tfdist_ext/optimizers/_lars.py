"""``LARS``: layer-wise adaptive rate scaling (You, Gitman and Ginsburg, 2017)."""

import math
import numbers
import re

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdist_ext")
class LARS(keras.optimizers.Optimizer):
    """SGD with momentum and a layer-wise trust ratio (LARS; You, Gitman and Ginsburg, 2017).

    The paper's Algorithm 1. For each variable ``w`` with gradient ``g``,
    global rate ``lr`` (a float or a schedule) and weight decay ``beta``::

        local_lr = eta * ||w|| / (||g|| + beta * ||w|| + epsilon)   (1 if ||w|| or ||g|| is 0)
        v <- momentum * v + lr * local_lr * (g + beta * w)
        w <- w - v

    By default, variables of rank <= 1 (biases, batch-norm gamma and beta) get
    neither the trust ratio nor the decay. The guide
    (``docs/api/guides/large_batch.rst``) covers the exclusions.

    Args:
      learning_rate: global rate (float >= 0), a
        ``keras.optimizers.schedules.LearningRateSchedule`` or a callable.
      momentum: in ``[0, 1)``; 0 keeps no velocity.
      weight_decay: ``beta`` (>= 0; ``None`` means 0), added to the gradient.
      eta: trust coefficient (>= 0), the paper's ``eta``.
      epsilon: added to the trust ratio's denominator (>= 0).
      exclude_from_weight_decay: name patterns (regular expressions) of
        variables without weight decay.
      exclude_from_layer_adaptation: name patterns of variables without the
        trust ratio; ``None``: ``exclude_from_weight_decay``.
      exclude_vectors: exclude every variable of rank <= 1 from both.
      name: the optimizer's name.
      **kwargs: Keras's common optimizer arguments (``clipnorm``, ``use_ema``,
        ``loss_scale_factor``, ``gradient_accumulation_steps``...).

    Example:
      >>> import keras, tfdist_ext
      >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
      >>> model.compile(optimizer=tfdist_ext.optimizers.LARS(1.0, weight_decay=5e-4),
      ...               loss="mse")
      >>> model.fit(keras.ops.ones((8, 4)), keras.ops.zeros((8, 2)), verbose=0)  # doctest: +ELLIPSIS
      <keras...History object at ...>
    """

    def __init__(
        self,
        learning_rate=1.0,
        momentum: float = 0.9,
        weight_decay: float | None = 0.0,
        eta: float = 0.001,
        epsilon: float = 0.0,
        exclude_from_weight_decay=None,
        exclude_from_layer_adaptation=None,
        exclude_vectors: bool = True,
        name: str = "lars",
        **kwargs,
    ):
        if isinstance(learning_rate, numbers.Number):
            _check_number("learning_rate", learning_rate)
        _check_number("momentum", momentum, below_one=True)
        _check_number("weight_decay", 0.0 if weight_decay is None else weight_decay)
        _check_number("eta", eta)
        _check_number("epsilon", epsilon)
        if not isinstance(exclude_vectors, bool):
            raise ValueError(
                f"LARS: exclude_vectors must be True or False, got {exclude_vectors!r}"
            )
        wd_names = _patterns("exclude_from_weight_decay", exclude_from_weight_decay)
        adaptation_names = (
            wd_names
            if exclude_from_layer_adaptation is None
            else _patterns("exclude_from_layer_adaptation", exclude_from_layer_adaptation)
        )
        super().__init__(
            learning_rate=learning_rate,
            weight_decay=float(weight_decay or 0.0),
            name=name,
            **kwargs,
        )
        self.momentum = float(momentum)
        self.eta = float(eta)
        self.epsilon = float(epsilon)
        self.exclude_vectors = exclude_vectors
        self._adaptation_names = adaptation_names
        self._adaptation_explicit = exclude_from_layer_adaptation is not None
        self.exclude_from_weight_decay(var_names=list(wd_names))

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Keras's method (see ``keras.optimizers.Optimizer``); also records
        ``var_names`` for ``get_config`` (a ``var_list`` is not serialisable)."""
        super().exclude_from_weight_decay(var_list=var_list, var_names=var_names)
        self._wd_names = tuple(var_names or ())

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.momentums = []
        if self.momentum:
            self.momentums = self.add_optimizer_variables(var_list, "momentum")

    def _apply_weight_decay(self, variables):
        # Keras's decoupled decay (w -= lr * wd * w before the update) is
        # replaced by LARS's, which update_step adds to the gradient.
        pass

    def _decays(self, variable):
        if self.exclude_vectors and len(variable.shape) <= 1:
            return False
        return bool(self.weight_decay) and self._use_weight_decay(variable)

    def _adapts(self, variable):
        if self.exclude_vectors and len(variable.shape) <= 1:
            return False
        names = self._adaptation_names
        return not (names and re.search("|".join(names), variable.name))

    def update_step(self, gradient, variable, learning_rate):
        """Applies one LARS step to ``variable``."""
        dtype = variable.dtype
        rate = ops.cast(learning_rate, dtype)
        gradient = ops.cast(gradient, dtype)
        decay = self.weight_decay if self._decays(variable) else 0.0
        if self._adapts(variable):
            w_norm = ops.sqrt(ops.sum(ops.square(variable)))
            g_norm = ops.sqrt(ops.sum(ops.square(gradient)))
            local = self.eta * w_norm / (g_norm + decay * w_norm + self.epsilon)
            both = ops.logical_and(ops.greater(w_norm, 0), ops.greater(g_norm, 0))
            rate = rate * ops.where(both, local, ops.ones_like(local))
        if decay:
            gradient = gradient + ops.cast(decay, dtype) * variable
        step = rate * gradient
        if self.momentum:
            velocity = self.momentums[self._get_variable_index(variable)]
            self.assign(velocity, ops.cast(self.momentum, dtype) * velocity + step)
            step = velocity
        self.assign_sub(variable, step)

    def get_config(self):
        config = super().get_config()
        config.update(
            momentum=self.momentum,
            eta=self.eta,
            epsilon=self.epsilon,
            exclude_from_weight_decay=list(self._wd_names),
            exclude_from_layer_adaptation=(
                list(self._adaptation_names) if self._adaptation_explicit else None
            ),
            exclude_vectors=self.exclude_vectors,
        )
        return config


def _check_number(name, value, below_one=False):
    bad = isinstance(value, bool) or not isinstance(value, numbers.Real)
    if bad or not math.isfinite(value) or value < 0 or (below_one and value >= 1):
        bound = "in [0, 1)" if below_one else "a finite number >= 0"
        raise ValueError(f"LARS: {name} must be {bound}, got {value!r}")


def _patterns(name, value):
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"LARS: {name} must be a list of name patterns (strings), got {value!r}")
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"LARS: {name} has an invalid pattern {pattern!r} ({e})") from None
    return tuple(value)
