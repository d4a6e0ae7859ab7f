"""The L-BFGS state on the parameter-server shards, and its vector algebra (internal).

"Communicate operations instead of values" (Dean et al., 2012): every vector
of the method -- the accepted point, its gradient, the search direction, the
gradient accumulator and the ``memory`` pairs (s, y) -- is split into the
same *blocks* as the model's parameters, and each block lives on the ``ps``
task that owns that parameter piece. Each method below is one
``tf.function`` run from the coordinator whose per-block ops are placed on
the block's ``ps`` task; only per-block partial sums (float64 scalars)
travel to the coordinator, and only scalars travel back.
:meth:`ShardedVectors.coordinator_bytes` counts those bytes from the traced
graphs: every tensor edge from an op on a ``ps`` task to one that is not.
"""

import numpy as np
import tensorflow as tf

_F64 = tf.float64


def _dot(a, b):
    """Block partial of a dot product, as a float64 scalar, computed where the block lives."""
    return tf.reduce_sum(tf.cast(a, _F64) * tf.cast(b, _F64))


class ShardedVectors:
    """L-BFGS vectors split like the parameters, each block on its ``ps`` task.

    Args:
      blocks: the parameter pieces (``tf.Variable`` on ``ps`` tasks); the
        model's variables themselves hold the point being evaluated.
      memory: number of (s, y) pairs kept.
      num_workers: one staging buffer per worker and block (a worker's slice
        gradient waits there until the coordinator commits it).
    """

    def __init__(self, blocks, memory, num_workers):
        self.blocks = list(blocks)
        self.memory = memory
        self.num_workers = num_workers

        def zeros(block, shape, name, dtype=None):
            with tf.device(block.device):
                return tf.Variable(
                    tf.zeros(shape, dtype or block.dtype),
                    trainable=False,
                    name=f"sandblaster_{name}",
                )

        # One list per vector, in block order.
        self.base = [zeros(b, b.shape, "x") for b in self.blocks]  # accepted point
        self.grad = [zeros(b, b.shape, "g") for b in self.blocks]  # its gradient
        self.direction = [zeros(b, b.shape, "d") for b in self.blocks]
        # float64: a sum of float32 slice gradients is then exact in practice,
        # so the gradient does not depend on the order slices finish in.
        self.accumulator = [zeros(b, b.shape, "acc", _F64) for b in self.blocks]
        self.s = [zeros(b, [memory, *b.shape], "s") for b in self.blocks]
        self.y = [zeros(b, [memory, *b.shape], "y") for b in self.blocks]
        self.stage = [
            [zeros(b, b.shape, f"stage{w}") for b in self.blocks] for w in range(num_workers)
        ]
        self.parameter_bytes = sum(b.shape.num_elements() * b.dtype.size for b in self.blocks)
        self._build_functions()

    def _build_functions(self):
        """One ``tf.function`` per operation (per worker for the commit).

        Each traces a body of :class:`_Bodies` once, from the coordinator.
        """
        bodies = _Bodies(self)
        self._zero_accumulator = tf.function(bodies.zero_accumulator)
        self._move_to = tf.function(bodies.move_to)
        self._restore = tf.function(bodies.restore)
        self._probe = tf.function(bodies.probe)
        self._start = tf.function(bodies.start)
        self._accept = tf.function(bodies.accept)
        self._steepest = tf.function(bodies.steepest)
        self._two_loop = tf.function(bodies.two_loop)
        self._commits = [tf.function(bodies.commit_for(w)) for w in range(self.num_workers)]

    # ------------------------------------------------------------ interface
    def zero_accumulator(self):
        """Accumulator <- 0 (before a pass)."""
        self._zero_accumulator()

    def commit(self, worker):
        """Accumulator += worker's staged slice gradient (runs on the ``ps`` tasks only)."""
        self._commits[worker]()

    def move_to(self, step):
        """Model parameters <- base + step * direction."""
        self._move_to(tf.constant(step, _F64))

    def restore(self):
        """Model parameters <- the last accepted point."""
        self._restore()

    def probe(self):
        """``(g.d, max|g|, finite)`` of the accumulated gradient."""
        slope, gmax, finite = self._probe()
        return float(slope), float(gmax), bool(finite)

    def start(self):
        """Makes the evaluated point the base; returns ``(g.g, max|g|)``."""
        gg, gmax = self._start()
        return float(gg), float(gmax)

    def accept(self, slot):
        """Stores (s, y) in ``slot``, moves the base; returns ``(s.y, y.y, max|g|)``."""
        sy, yy, gmax = self._accept(tf.constant(slot, tf.int32))
        return float(sy), float(yy), float(gmax)

    def steepest_descent(self):
        """Direction <- -g; returns ``(g.d, d.d)``."""
        slope, dd = self._steepest()
        return float(slope), float(dd)

    def lbfgs_direction(self, order, rho, gamma):
        """Direction <- -H g (two-loop recursion); returns ``(g.d, d.d)``."""
        order = list(order) + [0] * (self.memory - len(order))
        rho = list(rho) + [0.0] * (self.memory - len(rho))
        slope, dd = self._two_loop(
            tf.constant(order, tf.int32), tf.constant(rho, _F64), tf.constant(gamma, _F64)
        )
        return float(slope), float(dd)

    def coordinator_bytes(self):
        """Bytes each vector operation sends to the coordinator, from its traced graph.

        Counts every tensor edge from an op placed on a ``ps`` task to an op
        that is not (everything unplaced runs on the coordinator, which also
        computes the returned scalars).
        """
        m = self.memory
        calls = {
            "zero_accumulator": (self._zero_accumulator, ()),
            "commit": (self._commits[0], ()),
            "move_to": (self._move_to, (tf.constant(0.0, _F64),)),
            "restore": (self._restore, ()),
            "probe": (self._probe, ()),
            "start": (self._start, ()),
            "accept": (self._accept, (tf.constant(0, tf.int32),)),
            "steepest_descent": (self._steepest, ()),
            "lbfgs_direction": (
                self._two_loop,
                (
                    tf.constant([0] * m, tf.int32),
                    tf.constant([0.0] * m, _F64),
                    tf.constant(1.0, _F64),
                ),
            ),
        }
        return {
            name: _edge_bytes(fn.get_concrete_function(*args)) for name, (fn, args) in calls.items()
        }


class _Bodies:
    """The graph bodies of :class:`ShardedVectors`' operations, one method each.

    Every body reads and writes the same vectors, so they are methods of one
    object rather than closures in one long builder. A body creates each
    block's ops under that block's device (:meth:`per_block`): they run on
    its ``ps`` task, and only the scalars a body returns reach the
    coordinator.
    """

    def __init__(self, vectors):
        self.vectors = vectors

    def per_block(self, fn, *vectors):
        """``fn(block, *pieces)`` for each block, under the block's device, in block order."""
        out = []
        for i, block in enumerate(self.vectors.blocks):
            with tf.device(block.device):
                out.append(fn(block, *(v[i] for v in vectors)))
        return out

    def zero_accumulator(self):
        """Accumulator <- 0, so that a pass sums only its own slices."""
        self.per_block(lambda b, a: a.assign(tf.zeros_like(a)), self.vectors.accumulator)

    def commit_for(self, worker):
        """The body adding ``worker``'s staged slice gradient to the accumulator.

        One body per worker, bound to that worker's staging buffers, so a
        commit takes no arguments and sends nothing through the coordinator.
        """
        stage = self.vectors.stage[worker]

        def commit():
            self.per_block(
                lambda b, a, s: a.assign_add(tf.cast(s, _F64)), self.vectors.accumulator, stage
            )

        return commit

    def move_to(self, step):
        """Model variables <- base + step * direction (the trial point)."""
        v = self.vectors
        self.per_block(
            lambda b, x, d: b.assign(x + tf.cast(step, b.dtype) * d), v.base, v.direction
        )

    def restore(self):
        """Model variables <- the accepted point."""
        self.per_block(lambda b, x: b.assign(x), self.vectors.base)

    def probe(self):
        """After a pass: phi'(step) = g.d, max|g|, and whether g is finite."""
        v = self.vectors
        slope = tf.add_n(self.per_block(lambda b, g, d: _dot(g, d), v.accumulator, v.direction))
        gmax = tf.reduce_max(
            tf.stack(
                self.per_block(lambda b, g: tf.reduce_max(tf.abs(g.read_value())), v.accumulator)
            )
        )
        finite = tf.reduce_all(
            tf.stack(
                self.per_block(lambda b, g: tf.reduce_all(tf.math.is_finite(g)), v.accumulator)
            )
        )
        return slope, gmax, finite

    def start(self):
        """The first evaluated point becomes the base point; returns (g.g, max|g|)."""

        def one(b, x, g, a):
            x.assign(b)
            g.assign(tf.cast(a, b.dtype))
            return _dot(a, a), tf.reduce_max(tf.abs(a.read_value()))

        v = self.vectors
        parts = self.per_block(one, v.base, v.grad, v.accumulator)
        return tf.add_n([p[0] for p in parts]), tf.reduce_max(tf.stack([p[1] for p in parts]))

    def accept(self, slot):
        """Stores s = x_new - x and y = g_new - g in history slot ``slot``; moves the base.

        The new point and gradient become the base. Returns s.y, y.y and
        max|g|, all the coordinator needs to keep or drop the pair and to stop.
        """

        def one(b, x, g, a, s, y):
            s_new = b - x
            y_new = tf.cast(a, b.dtype) - g
            s.scatter_update(tf.IndexedSlices(s_new[None], slot[None]))
            y.scatter_update(tf.IndexedSlices(y_new[None], slot[None]))
            x.assign(b)
            g.assign(tf.cast(a, b.dtype))
            return (
                _dot(s_new, y_new),
                _dot(y_new, y_new),
                tf.reduce_max(tf.abs(a.read_value())),
            )

        v = self.vectors
        parts = self.per_block(one, v.base, v.grad, v.accumulator, v.s, v.y)
        return (
            tf.add_n([p[0] for p in parts]),
            tf.add_n([p[1] for p in parts]),
            tf.reduce_max(tf.stack([p[2] for p in parts])),
        )

    def steepest(self):
        """d = -g; returns (g.d, d.d)."""

        def one(b, g, d):
            d.assign(-g)
            return _dot(g, g)

        gg = tf.add_n(self.per_block(one, self.vectors.grad, self.vectors.direction))
        return -gg, gg

    def two_loop(self, order, rho, gamma):
        """d = -H g by the L-BFGS two-loop recursion; returns (g.d, d.d).

        ``order`` lists history slots newest first; ``rho[j] = 1 / (s.y)`` of
        slot ``order[j]``, 0 for unused slots (which then contribute
        nothing). Each dot is summed over the blocks on the coordinator; each
        axpy runs per block.
        """
        q = self.per_block(lambda b, g: tf.identity(g), self.vectors.grad)
        q, alphas = self._newest_first(q, order, rho)
        r = self.per_block(lambda b, qi: tf.cast(gamma, b.dtype) * qi, q)
        r = self._oldest_first(r, order, rho, alphas)

        def store(b, d, ri, g):
            d.assign(-ri)
            return -_dot(ri, g), _dot(ri, ri)

        parts = self.per_block(store, self.vectors.direction, r, self.vectors.grad)
        return tf.add_n([p[0] for p in parts]), tf.add_n([p[1] for p in parts])

    def _newest_first(self, q, order, rho):
        """The first loop, newest pair first: alpha_j = rho_j s_j.q, then q -= alpha_j y_j."""
        v = self.vectors
        alphas = []
        for j in range(v.memory):
            slot = order[j]
            partial = self.per_block(lambda b, s, qi: _dot(tf.gather(s, slot), qi), v.s, q)
            alpha = rho[j] * tf.add_n(partial)
            alphas.append(alpha)
            q = self.per_block(
                lambda b, y, qi: qi - tf.cast(alpha, b.dtype) * tf.gather(y, slot), v.y, q
            )
        return q, alphas

    def _oldest_first(self, r, order, rho, alphas):
        """The second loop, oldest pair first: r += (alpha_j - rho_j y_j.r) s_j."""
        v = self.vectors
        for j in reversed(range(v.memory)):
            slot = order[j]
            partial = self.per_block(lambda b, y, ri: _dot(tf.gather(y, slot), ri), v.y, r)
            coefficient = alphas[j] - rho[j] * tf.add_n(partial)
            r = self.per_block(
                lambda b, s, ri: ri + tf.cast(coefficient, b.dtype) * tf.gather(s, slot),
                v.s,
                r,
            )
        return r


def _edge_bytes(concrete):
    """Bytes of tensors crossing from ``/job:ps`` ops to ops elsewhere."""
    total = 0
    graph = concrete.graph
    for op in graph.get_operations():
        if "/job:ps" in op.device:
            continue
        for tensor in op.inputs:
            if "/job:ps" not in tensor.op.device or tensor.dtype == tf.resource:
                continue
            total += _tensor_bytes(tensor)
    return total


def _tensor_bytes(tensor):
    count = tensor.shape.num_elements()
    if count is None:
        raise ValueError(f"tensor {tensor.name} crossing to the coordinator has no static size")
    return count * tensor.dtype.size


def ring_order(head, count, memory):
    """History slots newest first, for a ring of ``memory`` slots whose next write is ``head``."""
    return [int(x) for x in (np.arange(head - 1, head - 1 - count, -1) % memory)]
