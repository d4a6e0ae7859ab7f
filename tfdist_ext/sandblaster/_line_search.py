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
    search = _StrongWolfeSearch(phi, f0, g0, c1, c2, max_evaluations)
    return search.bracket(min(step, max_step), max_step)


class _StrongWolfeSearch:
    """One line search: what its bracketing and zoom phases share.

    Both phases test their trial points against the same ``f0``, ``g0``,
    ``c1`` and ``c2`` and draw on one budget of evaluations, so they are
    methods of one object rather than a closure reaching into the caller's
    locals.
    """

    def __init__(self, phi, f0, g0, c1, c2, max_evaluations):
        self.phi = phi
        self.f0 = f0
        self.g0 = g0
        self.c1 = c1
        self.c2 = c2
        self.max_evaluations = max_evaluations
        self.evaluations = 0

    def evaluate(self, step):
        """``phi(step)``, counted: the count bounds the search and is returned with the step."""
        f, g = self.phi(step)
        self.evaluations += 1
        return f, g

    def too_high(self, step, f):
        """Whether ``f`` misses the sufficient decrease ``f0 + c1 * step * g0``."""
        return f > self.f0 + self.c1 * step * self.g0

    def flat_enough(self, g):
        """Whether the slope ``g`` meets the strong curvature condition ``|g| <= c2 * |g0|``."""
        return abs(g) <= -self.c2 * self.g0

    def bracket(self, step, max_step):
        """Algorithm 3.5: doubles ``step`` (up to ``max_step``) until it brackets a good step.

        A trial point meeting both conditions ends the search; one too high,
        no lower than the last, or sloping upwards closes a bracket to zoom into.
        """
        prev, f_prev, g_prev = 0.0, self.f0, self.g0
        while self.evaluations < self.max_evaluations:
            f, g = self.evaluate(step)
            if self.too_high(step, f) or (self.evaluations > 1 and f >= f_prev):
                return self.zoom(prev, f_prev, g_prev, step, f, g)
            if self.flat_enough(g):
                return step, f, g, self.evaluations
            if g >= 0.0:
                return self.zoom(step, f, g, prev, f_prev, g_prev)
            if step >= max_step:
                break
            prev, f_prev, g_prev = step, f, g
            step = min(2.0 * step, max_step)
        raise LineSearchError(
            f"no strong-Wolfe step up to {step:.3g} after {self.evaluations} evaluations",
            self.evaluations,
        )

    def zoom(self, lo, f_lo, g_lo, hi, f_hi, g_hi):
        """Algorithm 3.6: narrows ``[lo, hi]`` until a trial point meets both conditions.

        ``lo`` stays the lowest point so far with its slope pointing towards
        ``hi``, so the bracket keeps holding a step that satisfies them.
        """
        while self.evaluations < self.max_evaluations:
            trial = _interpolate(lo, f_lo, g_lo, hi, f_hi, g_hi)
            f, g = self.evaluate(trial)
            if self.too_high(trial, f) or f >= f_lo:
                hi, f_hi, g_hi = trial, f, g
                continue
            if self.flat_enough(g):
                return trial, f, g, self.evaluations
            if g * (hi - lo) >= 0.0:
                hi, f_hi, g_hi = lo, f_lo, g_lo
            lo, f_lo, g_lo = trial, f, g
        raise LineSearchError(
            f"no strong-Wolfe step in [{min(lo, hi):.3g}, {max(lo, hi):.3g}] after "
            f"{self.evaluations} evaluations",
            self.evaluations,
        )
