"""Optimizers of tfdist_ext: ``LBFGS`` (run by ``SandblasterStrategy``) and ``LARS``.

Example:
  >>> import tfdist_ext
  >>> opt = tfdist_ext.optimizers.LBFGS(memory=10, gtol=1e-5)
  >>> lars = tfdist_ext.optimizers.LARS(2.0, momentum=0.9, weight_decay=5e-4, eta=0.001)
"""

from tfdist_ext.optimizers._lars import LARS
from tfdist_ext.optimizers._lbfgs import LBFGS

__all__ = ["LARS", "LBFGS"]
