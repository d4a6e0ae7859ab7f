"""Optimizers of tfdist_ext: ``LBFGS`` (run by ``SandblasterStrategy``).

Example:
  >>> import tfdist_ext
  >>> opt = tfdist_ext.optimizers.LBFGS(memory=10, gtol=1e-5)
"""

from tfdist_ext.sandblaster._optimizer import LBFGS

__all__ = ["LBFGS"]
