"""A line search satisfying the strong Wolfe conditions (internal).

Bracketing then zoom with safeguarded cubic interpolation: Algorithms 3.5
and 3.6 of Nocedal & Wright, *Numerical Optimization* (2nd ed.), the method
of SciPy's ``scipy.optimize.line_search``. It works on scalars only: the
caller's ``phi(alpha)`` evaluates the objective and its directional
derivative at ``x + alpha * d`` (for Sandblaster, one distributed pass), so
the coordinator never sees a vector.

Every successful search ends on the point evaluated last, so the state the
caller keeps for "the current evaluation" (the parameters and gradient on
the ``ps`` shards) is the accepted point's.
"""

import math


class LineSearchError(RuntimeError):
    """No step satisfying the strong Wolfe conditions was found."""

    def __init__(self, message, evaluations):
        super().__init__(message)
        self.evaluations = evaluations


def _cubic_min(a, fa, ga, b, fb, gb):
    """Minimiser of the cubic through (a, fa, ga) and (b, fb, gb), or None."""
    if a == b:
        return None
    d1 = ga + gb - 3.0 * (fa - fb) / (a - b)
    radicand = d1 * d1 - ga * gb
    if radicand < 0.0:
        return None
    d2 = math.copysign(math.sqrt(radicand), b - a)
    denominator = gb - ga + 2.0 * d2
    if denominator == 0.0:
        return None
    return b - (b - a) * (gb + d2 - d1) / denominator


def _interpolate(lo, f_lo, g_lo, hi, f_hi, g_hi):
    """A trial step inside (lo, hi): the cubic's minimiser kept 10% away from the ends."""
    left, right = min(lo, hi), max(lo, hi)
    margin = 0.1 * (right - left)
    step = _cubic_min(lo, f_lo, g_lo, hi, f_hi, g_hi)
    if step is None or not (left + margin <= step <= right - margin):
        step = 0.5 * (lo + hi)
    return step


def strong_wolfe(phi, f0, g0, step, *, c1=1e-4, c2=0.9, max_evaluations=20, max_step=1e10):
    """Finds a step satisfying the strong Wolfe conditions.

    ``phi(step) -> (f, g)`` is the objective and its derivative along the
    search direction; ``g0 = phi'(0)`` must be negative. Returns
    ``(step, f, g, evaluations)`` for the point ``phi`` evaluated last, with
    ``f <= f0 + c1 * step * g0`` and ``|g| <= c2 * |g0|``.

    Raises:
      ValueError: ``g0`` is not a descent slope or ``0 < c1 < c2 < 1`` fails.
      LineSearchError: no such step within ``max_evaluations`` evaluations
        (typically round-off near a minimum).

    Example:
      >>> phi = lambda a: ((a - 2) ** 2, 2 * (a - 2))   # minimum at a = 2
      >>> strong_wolfe(phi, 4.0, -4.0, 1.0, c2=0.1)[0]
      2.0
    """
    if not 0.0 < c1 < c2 < 1.0:
        raise ValueError(f"line search needs 0 < c1 < c2 < 1, got c1={c1}, c2={c2}")
    if not g0 < 0.0:
        raise ValueError(f"line search needs a descent direction, got phi'(0) = {g0}")
    evaluations = 0
    prev, f_prev, g_prev = 0.0, f0, g0
    step = min(step, max_step)

    def zoom(lo, f_lo, g_lo, hi, f_hi, g_hi):
        nonlocal evaluations
        while evaluations < max_evaluations:
            trial = _interpolate(lo, f_lo, g_lo, hi, f_hi, g_hi)
            f, g = phi(trial)
            evaluations += 1
            if f > f0 + c1 * trial * g0 or f >= f_lo:
                hi, f_hi, g_hi = trial, f, g
                continue
            if abs(g) <= -c2 * g0:
                return trial, f, g, evaluations
            if g * (hi - lo) >= 0.0:
                hi, f_hi, g_hi = lo, f_lo, g_lo
            lo, f_lo, g_lo = trial, f, g
        raise LineSearchError(
            f"no strong-Wolfe step in [{min(lo, hi):.3g}, {max(lo, hi):.3g}] after "
            f"{evaluations} evaluations",
            evaluations,
        )

    while evaluations < max_evaluations:
        f, g = phi(step)
        evaluations += 1
        if f > f0 + c1 * step * g0 or (evaluations > 1 and f >= f_prev):
            return zoom(prev, f_prev, g_prev, step, f, g)
        if abs(g) <= -c2 * g0:
            return step, f, g, evaluations
        if g >= 0.0:
            return zoom(step, f, g, prev, f_prev, g_prev)
        if step >= max_step:
            break
        prev, f_prev, g_prev = step, f, g
        step = min(2.0 * step, max_step)
    raise LineSearchError(
        f"no strong-Wolfe step up to {step:.3g} after {evaluations} evaluations", evaluations
    )
