"""``LBFGS``: the optimizer a Keras user compiles a Sandblaster model with."""

import keras

# Bracketing + zoom with cubic interpolation (Nocedal & Wright 3.5/3.6, as
# scipy.optimize.line_search); the steps it accepts satisfy the strong Wolfe
# conditions.
_LINE_SEARCHES = ("strong_wolfe",)
_KERAS_ONLY = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


@keras.saving.register_keras_serializable(package="tfdist_ext")
class LBFGS(keras.optimizers.Optimizer):
    """Limited-memory BFGS with a strong-Wolfe line search, run by ``SandblasterStrategy``.

    A full-batch method: under ``SandblasterStrategy`` each ``fit`` step is
    one L-BFGS iteration over the whole training set (an epoch is one step
    unless ``steps_per_epoch`` says more), every function evaluation one
    distributed pass. The stopping rules are SciPy's ``L-BFGS-B`` ones, with
    its defaults; when one fires, training stops and the reason is in
    ``model.optimizer.result.message`` (``history.history["converged"]``
    marks the epoch). The objective is evaluated with ``training=False`` so
    that it is deterministic (no dropout; batch norm uses its moving
    statistics): regularisation losses are included.

    Args:
      memory: number of (s, y) correction pairs kept (SciPy's ``maxcor``).
      gtol: stop when ``max |gradient| <= gtol`` (SciPy's ``gtol``; TensorFlow
        Probability calls it ``tolerance``).
      ftol: stop when ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1) <= ftol``.
      max_iterations: stop after this many iterations (None: only ``epochs``).
      line_search: ``"strong_wolfe"``: bracketing and zoom with safeguarded
        cubic interpolation (Nocedal & Wright, Algorithms 3.5-3.6, the method
        of ``scipy.optimize.line_search``).
      max_line_search: function evaluations allowed per line search (``maxls``).
      c1, c2: sufficient-decrease and curvature constants of the strong
        Wolfe conditions, ``0 < c1 < c2 < 1``.

    Example:
      >>> strategy = tfdist_ext.SandblasterStrategy(cluster.resolver)  # doctest: +SKIP
      >>> with strategy.scope():  # doctest: +SKIP
      ...     model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      ...     model.compile(optimizer=tfdist_ext.optimizers.LBFGS(memory=10),
      ...                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
      >>> model.fit(x, y, epochs=50)  # doctest: +SKIP
    """

    def __init__(
        self,
        memory: int = 10,
        gtol: float = 1e-5,
        ftol: float = 2.220446049250313e-09,
        max_iterations: int | None = None,
        line_search: str = "strong_wolfe",
        max_line_search: int = 20,
        c1: float = 1e-4,
        c2: float = 0.9,
        name: str = "lbfgs",
        **kwargs,
    ):
        kwargs.pop("learning_rate", None)
        for key in _KERAS_ONLY:
            if kwargs.get(key) not in (None, False):
                raise ValueError(f"LBFGS: {key} is not supported (L-BFGS takes no such option)")
        if line_search not in _LINE_SEARCHES:
            raise ValueError(
                f"LBFGS: line_search must be one of {sorted(_LINE_SEARCHES)}, got {line_search!r}"
            )
        _check_int("memory", memory, 1)
        _check_int("max_line_search", max_line_search, 1)
        if max_iterations is not None:
            _check_int("max_iterations", max_iterations, 1)
        for key, value in (("gtol", gtol), ("ftol", ftol)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"LBFGS: {key} must be a number >= 0, got {value!r}")
        if not (isinstance(c1, (int, float)) and isinstance(c2, (int, float)) and 0 < c1 < c2 < 1):
            raise ValueError(f"LBFGS: need 0 < c1 < c2 < 1, got c1={c1!r}, c2={c2!r}")
        super().__init__(learning_rate=1.0, name=name, **kwargs)
        self.memory = memory
        self.gtol = float(gtol)
        self.ftol = float(ftol)
        self.max_iterations = max_iterations
        self.line_search = line_search
        self.max_line_search = max_line_search
        self.c1 = float(c1)
        self.c2 = float(c2)
        self._set_result(None)

    def _set_result(self, result):
        # Bypasses Keras's attribute tracking, which would turn the result
        # (a dict) into a tracked container.
        object.__setattr__(self, "result", result)

    def update_step(self, gradient, variable, learning_rate):
        raise NotImplementedError(
            "LBFGS is a full-batch method and does not apply single gradients: fit the "
            "model under tfdist_ext.SandblasterStrategy, or use "
            "tfdist_ext.sandblaster.minimize"
        )

    def get_config(self):
        config = super().get_config()
        for key in ("learning_rate",) + _KERAS_ONLY + ("ema_momentum", "ema_overwrite_frequency"):
            config.pop(key, None)
        config.update(
            memory=self.memory,
            gtol=self.gtol,
            ftol=self.ftol,
            max_iterations=self.max_iterations,
            line_search=self.line_search,
            max_line_search=self.max_line_search,
            c1=self.c1,
            c2=self.c2,
        )
        return config


def _check_int(name, value, low):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"LBFGS: {name} must be an integer >= {low}, got {value!r}")
