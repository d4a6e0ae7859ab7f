"""The coordinator's L-BFGS loop (internal).

Pure control flow on scalars: the vectors live on the ``ps`` shards
(:class:`~tfdist_ext.sandblaster._vectors.ShardedVectors`) and each function
evaluation is one distributed pass (:class:`~tfdist_ext.sandblaster._engine.Evaluator`).
Conventions follow SciPy's ``L-BFGS-B`` without bounds: the first step is
``1/||g||`` along ``-g``, later ones start at 1; a pair (s, y) is kept only
if ``s.y > eps * y.y``; the initial inverse Hessian is ``(s.y / y.y) I``;
stopping rules ``max|g| <= gtol``, ``(f_k - f_{k+1}) / max(|f_k|, |f_{k+1}|, 1)
<= ftol`` and an iteration limit, with SciPy's status codes and messages.
A failed line search restarts once from steepest descent, as SciPy does,
unless no trial point moved f beyond the round-off of the parameters' dtype
(float32 near a minimum), where a restart cannot help.
"""

import math
import time

import numpy as np

from tfdist_ext.sandblaster._line_search import LineSearchError
from tfdist_ext.sandblaster._line_search import strong_wolfe
from tfdist_ext.sandblaster._vectors import ring_order

_EPS = float(np.finfo(np.float64).eps)

CONVERGED_GTOL = "CONVERGENCE: NORM OF PROJECTED GRADIENT <= PGTOL"
CONVERGED_FTOL = "CONVERGENCE: RELATIVE REDUCTION OF F <= FACTR*EPSMCH"
ITERATION_LIMIT = "STOP: TOTAL NO. OF ITERATIONS REACHED LIMIT"
LINE_SEARCH_FAILED = "ABNORMAL: LINE SEARCH FAILED"
LINE_SEARCH_ROUND_OFF = "ABNORMAL: LINE SEARCH FAILED (no decrease beyond round-off)"


class OptimizeResult(dict):
    """The outcome of an L-BFGS run, with SciPy's field names.

    Keys (also attributes): ``fun`` (final loss), ``nit`` (iterations),
    ``nfev`` (function evaluations = distributed passes), ``status`` (0
    converged, 1 iteration limit, 2 line search failed, None still running),
    ``success``, ``message``, ``grad_max`` (largest absolute gradient entry at the end) and
    ``history`` (one dict per iteration).

    Example:
      >>> r = OptimizeResult(fun=0.5, nit=3, status=0)
      >>> r.fun, r["nit"]
      (0.5, 3)
    """

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class LBFGSRun:
    """One L-BFGS run: ``step()`` does one iteration; state persists between calls."""

    def __init__(self, options, vectors, evaluator):
        self.options = options
        self.vectors = vectors
        self.evaluator = evaluator
        self.memory = options.memory
        self.op_bytes = vectors.coordinator_bytes()
        self.nit = 0
        self.nfev = 0
        self.f = None
        self.aux = None
        self.grad_max = None
        self.status = None
        self.message = "running"
        self.history = []
        self._head = 0
        self._count = 0
        self._rho = [0.0] * self.memory
        self._gamma = 1.0
        self._last = None
        self._trials = []  # f at each trial point of the current line search

    # ------------------------------------------------------------ helpers
    def _op(self, name, *args):
        self._bytes += self.op_bytes[name]
        return getattr(self.vectors, name)(*args)

    def _evaluate(self, step=None):
        """One pass at the current parameters; returns (f, phi'(step)); the report is in ``_last``."""
        report = self.evaluator.run_pass()
        self.nfev += 1
        self._passes += 1
        self._bytes += report.received_bytes + self.op_bytes["zero_accumulator"]
        self._bytes += self.op_bytes["commit"] * report.slices
        self._backups += report.backups
        self._wasted += report.wasted
        slope, _, finite = self._op("probe")
        if not (finite and math.isfinite(report.loss)):
            what = "loss" if not math.isfinite(report.loss) else "gradient"
            where = f"iteration {self.nit + 1}, function evaluation {self.nfev}" + (
                "" if step is None else f", step size {step:.3g}"
            )
            if self.f is not None:
                self._op("restore")
                kept = f"the model keeps the parameters of iteration {self.nit}"
            else:
                kept = "the model keeps its initial parameters"
            raise FloatingPointError(
                f"Sandblaster L-BFGS: the {what} is NaN or Inf at {where}; {kept}"
            )
        self._last = report
        return report.loss, slope

    def _begin(self):
        f, _ = self._evaluate()
        _, self.grad_max = self._op("start")
        self.f, self.aux = f, self._last.aux
        if self.grad_max <= self.options.gtol:
            self._stop(0, CONVERGED_GTOL)

    def _stop(self, status, message):
        self.status, self.message = status, message

    def _direction(self):
        if self._count == 0:
            slope, dd = self._op("steepest_descent")
            return slope, dd
        order = ring_order(self._head, self._count, self.memory)
        rho = [self._rho[i] for i in order]
        slope, dd = self._op("lbfgs_direction", order, rho, self._gamma)
        if not slope < 0.0:  # not a descent direction (round-off): restart
            self._count = 0
            slope, dd = self._op("steepest_descent")
        return slope, dd

    def _at_round_off(self):
        """Whether no trial point of the failed search moved f beyond the parameters' round-off."""
        eps = float(np.finfo(self.vectors.blocks[0].dtype.as_numpy_dtype).eps)
        spread = max((abs(f - self.f) for f in self._trials), default=0.0)
        return spread <= 16.0 * eps * max(abs(self.f), 1.0)

    def _line_search(self, slope, dd):
        # As L-BFGS-B: a first step of length 1 along -g, then unit steps.
        first_step = 1.0 if self._count else min(1.0 / math.sqrt(dd), 1e10)

        self._trials = []

        def phi(step):
            self._op("move_to", step)
            f, s = self._evaluate(step)
            self._trials.append(f)
            return f, s

        o = self.options
        return strong_wolfe(
            phi, self.f, slope, first_step, c1=o.c1, c2=o.c2, max_evaluations=o.max_line_search
        )

    # ------------------------------------------------------------ interface
    @property
    def done(self):
        """Whether a stopping rule fired."""
        return self.status is not None

    def step(self):
        """Runs one iteration (the first call also evaluates the start point).

        Returns the iteration's record (also appended to ``history``).

        Raises:
          FloatingPointError: NaN/Inf loss or gradient; the model keeps the
            last good parameters.
        """
        if self.done:
            return self.history[-1] if self.history else None
        t0 = time.perf_counter()
        self._bytes = self._passes = self._backups = self._wasted = 0
        if self.f is None:
            self._begin()
            if self.done:
                return self._record(t0, 0.0)
        slope, dd = self._direction()
        try:
            step, f, _, _ = self._line_search(slope, dd)
        except LineSearchError:
            self._op("restore")
            if self._at_round_off():
                # f cannot decrease beyond the round-off of the parameters'
                # dtype (float32 near a minimum): a steepest-descent retry
                # would only spend another max_line_search passes.
                self._stop(2, LINE_SEARCH_ROUND_OFF)
                return self._record(t0, 0.0)
            if self._count:  # forget the history and try steepest descent once
                self._count = 0
                slope, dd = self._direction()
                try:
                    step, f, _, _ = self._line_search(slope, dd)
                except LineSearchError:
                    self._op("restore")
                    self._stop(2, LINE_SEARCH_FAILED)
                    return self._record(t0, 0.0)
            else:
                self._stop(2, LINE_SEARCH_FAILED)
                return self._record(t0, 0.0)
        sy, yy, self.grad_max = self._op("accept", self._head)
        if sy > _EPS * yy:
            self._rho[self._head] = 1.0 / sy
            self._gamma = sy / yy
            self._head = (self._head + 1) % self.memory
            self._count = min(self._count + 1, self.memory)
        elif self._count == self.memory:
            # The pair was written over the oldest slot but not kept: drop that slot.
            self._count -= 1
        previous, self.f, self.aux = self.f, f, self._last.aux
        self.nit += 1
        o = self.options
        if (previous - f) / max(abs(previous), abs(f), 1.0) <= o.ftol:
            self._stop(0, CONVERGED_FTOL)
        elif self.grad_max <= o.gtol:
            self._stop(0, CONVERGED_GTOL)
        elif o.max_iterations is not None and self.nit >= o.max_iterations:
            self._stop(1, ITERATION_LIMIT)
        return self._record(t0, step)

    def _record(self, t0, step):
        record = {
            "iteration": self.nit,
            "loss": self.f,
            "grad_max": self.grad_max,
            "step_size": step,
            "function_evals": self._passes,
            "coordinator_bytes": self._bytes,
            "backup_slices": self._backups,
            "wasted_slices": self._wasted,
            "seconds": time.perf_counter() - t0,
            "converged": int(self.status == 0),
        }
        self.history.append(record)
        return record

    def result(self):
        """The run so far as an :class:`OptimizeResult`."""
        return OptimizeResult(
            fun=self.f,
            nit=self.nit,
            nfev=self.nfev,
            status=self.status,
            success=self.status == 0,
            message=self.message,
            grad_max=self.grad_max,
            history=list(self.history),
        )
