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

    # ------------------------------------------------------------------ ops
    def _per_block(self, fn, *vectors):
        out = []
        for i, block in enumerate(self.blocks):
            with tf.device(block.device):
                out.append(fn(block, *(v[i] for v in vectors)))
        return out

    def _build_functions(self):
        @tf.function
        def zero_accumulator():
            self._per_block(lambda b, a: a.assign(tf.zeros_like(a)), self.accumulator)

        @tf.function
        def move_to(step):
            # Model variables <- base + step * direction (the trial point).
            self._per_block(
                lambda b, x, d: b.assign(x + tf.cast(step, b.dtype) * d), self.base, self.direction
            )

        @tf.function
        def restore():
            self._per_block(lambda b, x: b.assign(x), self.base)

        @tf.function
        def probe():
            # After a pass: phi'(step) = g.d, max|g|, and whether g is finite.
            slope = tf.add_n(
                self._per_block(lambda b, g, d: _dot(g, d), self.accumulator, self.direction)
            )
            gmax = tf.reduce_max(
                tf.stack(
                    self._per_block(
                        lambda b, g: tf.reduce_max(tf.abs(g.read_value())), self.accumulator
                    )
                )
            )
            finite = tf.reduce_all(
                tf.stack(
                    self._per_block(
                        lambda b, g: tf.reduce_all(tf.math.is_finite(g)), self.accumulator
                    )
                )
            )
            return slope, gmax, finite

        @tf.function
        def start():
            # The first evaluated point becomes the base point.
            def one(b, x, g, a):
                x.assign(b)
                g.assign(tf.cast(a, b.dtype))
                return _dot(a, a), tf.reduce_max(tf.abs(a.read_value()))

            parts = self._per_block(one, self.base, self.grad, self.accumulator)
            return tf.add_n([p[0] for p in parts]), tf.reduce_max(tf.stack([p[1] for p in parts]))

        @tf.function
        def accept(slot):
            # s = x_new - x, y = g_new - g stored in history slot `slot`; the
            # new point and gradient become the base. Returns s.y, y.y, max|g|.
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

            parts = self._per_block(one, self.base, self.grad, self.accumulator, self.s, self.y)
            return (
                tf.add_n([p[0] for p in parts]),
                tf.add_n([p[1] for p in parts]),
                tf.reduce_max(tf.stack([p[2] for p in parts])),
            )

        @tf.function
        def steepest():
            # d = -g; returns (g.d, d.d).
            def one(b, g, d):
                d.assign(-g)
                return _dot(g, g)

            gg = tf.add_n(self._per_block(one, self.grad, self.direction))
            return -gg, gg

        @tf.function
        def two_loop(order, rho, gamma):
            # d = -H g by the L-BFGS two-loop recursion. `order` lists history
            # slots newest first; rho[j] = 1 / (s.y) of slot order[j], 0 for
            # unused slots (which then contribute nothing). Each dot is summed
            # over the blocks on the coordinator; each axpy runs per block.
            q = self._per_block(lambda b, g: tf.identity(g), self.grad)
            alphas = []
            for j in range(self.memory):
                slot = order[j]
                partial = self._per_block(lambda b, s, qi: _dot(tf.gather(s, slot), qi), self.s, q)
                alpha = rho[j] * tf.add_n(partial)
                alphas.append(alpha)
                q = self._per_block(
                    lambda b, y, qi: qi - tf.cast(alpha, b.dtype) * tf.gather(y, slot), self.y, q
                )
            r = self._per_block(lambda b, qi: tf.cast(gamma, b.dtype) * qi, q)
            for j in reversed(range(self.memory)):
                slot = order[j]
                partial = self._per_block(lambda b, y, ri: _dot(tf.gather(y, slot), ri), self.y, r)
                coefficient = alphas[j] - rho[j] * tf.add_n(partial)
                r = self._per_block(
                    lambda b, s, ri: ri + tf.cast(coefficient, b.dtype) * tf.gather(s, slot),
                    self.s,
                    r,
                )

            def store(b, d, ri, g):
                d.assign(-ri)
                return -_dot(ri, g), _dot(ri, ri)

            parts = self._per_block(store, self.direction, r, self.grad)
            return tf.add_n([p[0] for p in parts]), tf.add_n([p[1] for p in parts])

        self._zero_accumulator = zero_accumulator
        self._move_to = move_to
        self._restore = restore
        self._probe = probe
        self._start = start
        self._accept = accept
        self._steepest = steepest
        self._two_loop = two_loop
        self._commits = [self._make_commit(w) for w in range(self.num_workers)]

    def _make_commit(self, worker):
        stage = self.stage[worker]

        @tf.function
        def commit():
            self._per_block(lambda b, a, s: a.assign_add(tf.cast(s, _F64)), self.accumulator, stage)

        return commit

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
