"""One chief at a time on a cluster's parameter servers (internal).

A second coordinator that connects to the ``ps`` and ``worker`` tasks another
one trains on makes both jobs' rounds stall until their deadlines, and both
fail. So ``ps:0`` keeps a lease: a string resource under a fixed shared name.
Eager variables are anonymous, one per client; a named resource lives in the
server's resource manager, which every client of that server sees. The lease
holds the address of the chief that claimed it. A new chief reads it before it
sends anything to a worker:

- the address is its own (a second strategy in the same process, or a job
  relaunched with the same ``TF_CONFIG``): it claims the lease;
- the chief there no longer answers (its job ended or was killed): it takes
  the lease over;
- the chief there answers: it is training, or has not closed its strategy,
  and the newcomer is refused with a ``ClusterError`` naming it.

The check and the claim are two operations, so two chiefs started in the same
instant can both pass it; the lease guards against the common case, a job
started while another still runs, not against that race.
"""

import tensorflow as tf

from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ping

_SHARED_NAME = "tfdist_ext_chief_lease"
_DEVICE = "/job:ps/replica:0/task:0/device:CPU:0"


class ChiefLease:
    """The claim of this process's chief (``spec["chief"][0]``) on ``ps:0``.

    A cluster spec without a ``chief`` job has no address to check or to
    store, and its lease is never claimed.
    """

    def __init__(self, owner, spec):
        self._owner = owner
        self._address = (spec.get("chief") or [""])[0]
        self._ps = spec["ps"][0]
        self._held = False

    def claim(self, timeout):
        """Claims the lease, or raises ``ClusterError`` when another live chief holds it.

        ``timeout`` bounds the wait for the holder's answer.
        """
        if not self._address:
            return
        handle = _handle()
        holder = _read(handle)
        if holder and holder != self._address and _answers(holder, timeout):
            raise ClusterError(
                f"{self._owner}: the parameter servers are in use: the chief at {holder} "
                f"is connected to ps:0 ({self._ps}) and still answers. A cluster has one "
                "chief at a time; a second one would stall both jobs. Let that job end "
                "(or call strategy.close() in it), or give this job its own ps and worker "
                "tasks."
            )
        _write(handle, self._address)
        self._held = True

    def release(self):
        """Clears the lease if this chief still holds it; a ``ps:0`` that is gone
        took the lease with it."""
        if not self._held:
            return
        self._held = False
        try:
            handle = _handle()
            if _read(handle) == self._address:
                _write(handle, "")
        except tf.errors.OpError:
            pass


def _handle():
    with tf.device(_DEVICE):
        return tf.raw_ops.VarHandleOp(dtype=tf.string, shape=[], shared_name=_SHARED_NAME)


def _read(handle):
    with tf.device(_DEVICE):
        if not tf.raw_ops.VarIsInitializedOp(resource=handle):
            return ""
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.string).numpy().decode()


def _write(handle, address):
    with tf.device(_DEVICE):
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.constant(address))


def _answers(address, timeout):
    try:
        ping(address, timeout=timeout)
    except ClusterError:
        return False
    return True
