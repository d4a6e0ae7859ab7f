"""``minimize``: Sandblaster L-BFGS outside Keras."""

import time
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tfdist_ext.optimizers._lbfgs import LBFGS
from tfdist_ext.sandblaster._fit import read_dataset
from tfdist_ext.sandblaster._lbfgs import LBFGSRun
from tfdist_ext.sandblaster._lbfgs import OptimizeResult


def minimize(
    loss_fn: Callable,
    variables: Sequence[tf.Variable],
    data,
    *,
    strategy: tf.distribute.Strategy,
    memory: int = 10,
    gtol: float = 1e-5,
    ftol: float = 2.220446049250313e-09,
    max_iterations: int = 15000,
    max_line_search: int = 20,
    c1: float = 1e-4,
    c2: float = 0.9,
    callback: Callable | None = None,
    verbose: int = 0,
) -> OptimizeResult:
    """Minimises the mean of ``loss_fn`` over ``data`` by Sandblaster L-BFGS.

    For users outside Keras, as ``scipy.optimize.minimize``: ``loss_fn(params, batch)`` is the
    mean loss over ``batch`` at ``params`` (a tensor per variable, in order); its regularisation
    terms are weighted by each slice's share of the data, so they count once in total.

    Args:
      loss_fn: returns a scalar tensor; traceable by ``tf.function`` (it runs on the workers).
      variables: ``tf.Variable`` objects created under ``strategy.scope()`` (so they live on the
        ``ps`` tasks); they hold the result at the end.
      data: a tuple (or nest) of arrays with a common first dimension, or a finite
        ``tf.data.Dataset`` of batches of such tuples (read once); ``batch`` has that structure.
      strategy: a ``SandblasterStrategy``.
      memory, gtol, ftol, max_iterations, max_line_search, c1, c2: as in ``optimizers.LBFGS``.
      callback: called with each iteration's record (a dict).
      verbose: 0 (silent) or 1: a line per iteration (as SciPy's ``disp``): iteration, loss,
        max abs(gradient), passes, seconds since the start; and a last line with the reason.

    Returns:
      An ``OptimizeResult`` (``fun``, ``nit``, ``nfev``, ``status``, ``success``, ``message``,
      ``grad_max``, ``history``, and ``x``: the variables' final values as arrays).

    Raises:
      FloatingPointError: NaN/Inf in the loss or gradient; the variables keep the last good values.

    Example:
      >>> with strategy.scope():  # doctest: +SKIP
      ...     w = tf.Variable(tf.zeros([64, 10]))
      >>> def loss_fn(params, batch):  # doctest: +SKIP
      ...     logits = tf.matmul(batch[0], params[0])
      ...     return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(batch[1], logits))
      >>> result = minimize(loss_fn, [w], (x, y), strategy=strategy, verbose=1)  # doctest: +SKIP
      L-BFGS iteration    1: loss 1.6722314  max|g| 2.31e-01  passes  2     0.4 s
      ...
    """
    options = _lbfgs_options(memory, gtol, ftol, max_iterations, max_line_search, c1, c2)
    variables = _checked_variables(variables, strategy, verbose)
    evaluator = _evaluator(strategy, loss_fn, variables, data, memory)
    return _run(options, evaluator, variables, callback, verbose)


def _lbfgs_options(memory, gtol, ftol, max_iterations, max_line_search, c1, c2):
    """The options as an ``LBFGS`` optimizer, whose checks give ``fit``'s messages."""
    return LBFGS(
        memory=memory,
        gtol=gtol,
        ftol=ftol,
        max_iterations=max_iterations,
        max_line_search=max_line_search,
        c1=c1,
        c2=c2,
    )


def _checked_variables(variables, strategy, verbose):
    """``variables`` as a list, once the arguments that need no data are checked.

    These mistakes fail before the data is read or sent to the workers.
    """
    if verbose not in (0, 1):
        raise ValueError(
            f"minimize: verbose must be 0 (silent) or 1 (a line per iteration), got {verbose!r}"
        )
    if not getattr(strategy, "_owner", None) == "SandblasterStrategy":
        raise ValueError(f"minimize: strategy must be a SandblasterStrategy, got {strategy!r}")
    variables = list(variables)
    if not variables:
        raise ValueError("minimize: no variables to optimise")
    return variables


def _examples(data):
    """``data`` as a nest of NumPy arrays of one length (a dataset is read once, here)."""
    if isinstance(data, tf.data.Dataset):
        data = read_dataset(data, "minimize")
    data = tf.nest.map_structure(np.asarray, data)
    sizes = {len(a) for a in tf.nest.flatten(data)}
    if len(sizes) != 1:
        raise ValueError(
            f"minimize: the arrays of data have different numbers of examples: {sorted(sizes)}"
        )
    return data


def _evaluator(strategy, loss_fn, variables, data, memory):
    """The strategy's pass machinery for ``loss_fn``, kept for later calls on the same arrays."""
    data = _examples(data)

    # The engine also sums metric state over the slices; outside Keras there is none.
    def objective(params, batch):
        return loss_fn(params, batch), []

    return strategy._evaluator(
        ("minimize", id(loss_fn)), loss_fn, variables, objective, data, memory
    )


def _run(options, evaluator, variables, callback, verbose):
    """L-BFGS until a stopping rule fires; its result, with the variables' values as ``x``."""
    run = LBFGSRun(options, evaluator.vectors, evaluator)
    start = time.perf_counter()
    while not run.done:
        record = run.step()
        if verbose:
            print_iteration(record, time.perf_counter() - start)
        if callback is not None:
            callback(record)
    result = run.result()
    if verbose:
        print(
            f"L-BFGS stopped after {result.nit} iterations, {result.nfev} passes, "
            f"{time.perf_counter() - start:.1f} s: {result.message}",
            flush=True,
        )
    result["x"] = [v.numpy() for v in variables]
    return result


def print_iteration(record, seconds):
    """One line of progress for an iteration's record (``verbose=1``)."""
    print(
        f"L-BFGS iteration {record['iteration']:4d}: loss {record['loss']:.8g}  "
        f"max|g| {record['grad_max']:.2e}  passes {record['function_evals']:2d}  "
        f"{seconds:6.1f} s",
        flush=True,
    )
