"""The compressors: none, fp16/bf16, sparsifiers, quantizers, sign methods, PowerSGD (internal)."""

import math

import keras
import tensorflow as tf

from tfdist_ext.compression import _wire
from tfdist_ext.compression._base import Compressor
from tfdist_ext.compression._base import ErrorFeedback
from tfdist_ext.compression._base import _flat32
from tfdist_ext.compression._base import _restore
from tfdist_ext.compression._base import check_positive
from tfdist_ext.compression._base import check_ratio

register = keras.saving.register_keras_serializable(package="tfdist_ext")

# Above this many elements, top-k selection estimates its threshold from a
# random sample (as DGC does) instead of an exact top_k, which costs more on
# tensors this large; below it the exact selection is about as fast and never
# falls short of k (timings: benchmarks/NOTES.md). The sample is at least
# SAMPLE_FRACTION of the tensor and large enough to hold about SAMPLE_HITS
# entries of the top k.
EXACT_TOPK_LIMIT = 1 << 18
SAMPLE_FRACTION = 0.01
SAMPLE_HITS = 64


def _num(shape):
    return _wire.static_num_elements(shape)


def _sparse_decompress(wire, shape, dtype):
    return _sparse_aggregate([wire], shape, dtype)


def _sparse_aggregate(wires, shape, dtype):
    """The dense sum of sparse wires (values + indices): one ``scatter_nd``.

    ``scatter_nd`` adds the values of repeated indices, so every sender's
    entries are summed where they coincide; it is used rather than
    ``unsorted_segment_sum``, which is much slower on CPU for a sparse wire
    into a large tensor (benchmarks/NOTES.md).
    """
    n = _num(shape)
    indices = tf.concat([w["indices"] for w in wires], 0)
    values = tf.concat([w["values"] for w in wires], 0)
    dense = tf.scatter_nd(tf.reshape(indices, [-1, 1]), values, [n])
    return _restore(dense, shape, dtype)


def select_topk(magnitude, k, seed):
    """Indices (int32) of the ``k`` largest entries of the flat ``magnitude``.

    Exact ``top_k`` up to :data:`EXACT_TOPK_LIMIT` elements; above it, DGC's
    sampling: a random sample estimates the threshold of the top ``k``, set
    three standard deviations of the estimate low so that the entries above
    it include the true top ``k`` almost always, and an exact ``top_k`` over
    those few candidates cuts them to ``k``. So the result is the exact top
    ``k`` except, rarely, fewer indices when the sample's estimate was high.
    """
    n = magnitude.shape[0]
    if n <= EXACT_TOPK_LIMIT:
        return tf.math.top_k(magnitude, k, sorted=False).indices
    k = tf.cast(k, tf.int32)
    density = tf.cast(k, tf.float32) / n
    least = float(math.ceil(n * SAMPLE_FRACTION))
    s = tf.cast(
        tf.minimum(float(n), tf.maximum(least, tf.math.ceil(SAMPLE_HITS / density))), tf.int32
    )
    sample = tf.gather(magnitude, tf.random.stateless_uniform([s], seed, 0, n, dtype=tf.int32))
    hits = density * tf.cast(s, tf.float32)  # expected sampled entries of the top k
    rank = tf.minimum(tf.cast(tf.math.ceil(hits + 3.0 * tf.sqrt(hits)), tf.int32) + 1, s)
    threshold = tf.reduce_min(tf.math.top_k(sample, rank, sorted=False).values)
    candidates = tf.cast(tf.reshape(tf.where(magnitude >= threshold), [-1]), tf.int32)
    chosen = tf.math.top_k(
        tf.gather(magnitude, candidates), tf.minimum(k, tf.size(candidates)), sorted=False
    ).indices
    return tf.gather(candidates, chosen)


def _summed_as(dtype, grads, states, all_sum):
    """``exchange`` of a stateless compressor whose wire is the gradient cast to
    ``dtype``: one ``all_sum`` of the casts, back in each gradient's dtype.
    Returns ``(summed_grads, states, bytes_sent)``."""
    sums = all_sum([tf.cast(g, dtype) for g in grads])
    totals = [tf.cast(t, g.dtype) for t, g in zip(sums, grads)]
    words = sum(_num(g.shape) for g in grads)
    return totals, states, tf.constant(tf.as_dtype(dtype).size * words, tf.int64)


def _seed(step, salt):
    return tf.stack([tf.cast(salt, tf.int32), tf.cast(step, tf.int32)])


@register
class NoCompression(Compressor):
    """Sends the dense float32 gradient (the reference point; ratio 1).

    Under the compressed strategies the gradients are summed by one batched
    all-reduce (:meth:`exchange`), as ``MultiWorkerMirroredStrategy`` and
    Horovod's ``Compression.none`` do.

    Example:
      >>> wire, _ = NoCompression().compress(tf.ones([3]), {}, 0)
    """

    name = "none"

    def compress(self, grad, state, step):
        return {"values": _flat32(grad)}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        return _restore(wire["values"], shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        return _restore(tf.add_n([w["values"] for w in wires]), shape, dtype)

    def exchange(self, grads, states, step, all_sum):
        """Sums the dense gradients in one all-reduce (a ring across workers, as
        ``MultiWorkerMirroredStrategy`` does), not an all-gather of every sender's.

        Returns ``(summed_grads, states, bytes_sent)``.
        """
        return _summed_as(tf.float32, grads, states, all_sum)


@register
class FP16(Compressor):
    """Casts to IEEE half precision on the wire (2 bytes per value; Horovod's ``Compression.fp16``).

    Example:
      >>> wire, _ = FP16().compress(tf.ones([4]), {}, 0)   # 2 int32 words
    """

    name = "fp16"
    wire_dtype = tf.float16

    def compress(self, grad, state, step):
        return {"words": _wire.pack_half(_flat32(grad), self.wire_dtype)}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        flat = _wire.unpack_half(wire["words"], self.wire_dtype, _num(shape))
        return _restore(flat, shape, dtype)

    def exchange(self, grads, states, step, all_sum):
        """Sums the gradients in one all-reduce in the 16-bit dtype, as Horovod's
        ``Compression.fp16`` does (each partial sum is rounded to 16 bits).

        A ring all-reduce sends 2(N-1)/N of the half-size buffer per worker,
        where an all-gather of every sender's sends N-1 of it.
        Returns ``(summed_grads, states, bytes_sent)``.
        """
        return _summed_as(self.wire_dtype, grads, states, all_sum)


@register
class BF16(FP16):
    """Casts to bfloat16 on the wire (float32's range, 8 bits of mantissa).

    Example:
      >>> wire, _ = BF16().compress(tf.ones([4]), {}, 0)
    """

    name = "bf16"
    wire_dtype = tf.bfloat16


@register
class TopK(Compressor):
    """Sends the ``ratio`` fraction of largest-magnitude entries: float32 values + int32 indices.

    Wrap in :class:`ErrorFeedback` to accumulate what is not sent.

    Example:
      >>> c = ErrorFeedback(TopK(0.01))
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01):
        self.ratio = check_ratio("TopK", "ratio", ratio)

    def k(self, n):
        return max(1, int(math.ceil(self.ratio * n)))

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        idx = select_topk(tf.abs(flat), self.k(flat.shape[0]), _seed(step, 17))
        return {"values": tf.gather(flat, idx), "indices": idx}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        return _sparse_decompress(wire, shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        return _sparse_aggregate(wires, shape, dtype)

    def get_config(self):
        return {"ratio": self.ratio}


@register
class RandomK(Compressor):
    """Sends ``ratio`` of the entries chosen at random; only the values travel.

    The indices come from a stateless generator seeded by ``(seed, step,
    size)``, so every receiver regenerates them from the 8-byte seed on the
    wire instead of receiving 4 bytes per index.

    Example:
      >>> c = ErrorFeedback(RandomK(0.01, seed=0))
    """

    name = "randomk"

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        self.ratio = check_ratio("RandomK", "ratio", ratio)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"RandomK: seed must be an integer, got {seed!r}")
        self.seed = seed

    def _indices(self, seed, n):
        k = max(1, int(math.ceil(self.ratio * n)))
        keys = tf.random.stateless_uniform([n], seed)
        return tf.math.top_k(keys, k, sorted=False).indices

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        n = flat.shape[0]
        seed = _seed(step, self.seed * 1000003 + n % 1000003)
        idx = self._indices(seed, n)
        return {"values": tf.gather(flat, idx), "seed": seed}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        return self.aggregate([wire], shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        # Each sender's indices, regenerated from its seed: one scatter of
        # every sender's values, not a dense tensor per sender.
        n = _num(shape)
        sparse = [{"indices": self._indices(w["seed"], n), "values": w["values"]} for w in wires]
        return _sparse_aggregate(sparse, shape, dtype)

    def get_config(self):
        return {"ratio": self.ratio, "seed": self.seed}


@register
class Threshold(Compressor):
    """Sends every entry with ``|g| >= tau`` (variable length): float32 values + int32 indices.

    Example:
      >>> c = ErrorFeedback(Threshold(1e-3))
    """

    name = "threshold"

    def __init__(self, tau: float = 1e-3):
        self.tau = float(check_positive("Threshold", "tau", tau))

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        idx = tf.cast(tf.reshape(tf.where(tf.abs(flat) >= self.tau), [-1]), tf.int32)
        return {"values": tf.gather(flat, idx), "indices": idx}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        return _sparse_decompress(wire, shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        return _sparse_aggregate(wires, shape, dtype)

    def get_config(self):
        return {"tau": self.tau}


@register
class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): stochastic rounding of ``|g|/||g||`` to ``levels`` levels.

    Wire: the float32 norm, one packed sign bit per entry and a packed level
    code per entry (the smallest of 1/2/4/8/16 bits that holds ``levels + 1``
    codes). Unbiased.

    Example:
      >>> c = QSGD(levels=4, seed=0)   # 1 sign bit + 4 level bits per entry
    """

    name = "qsgd"

    def __init__(self, levels: int = 4, seed: int = 0):
        if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
            raise ValueError(f"QSGD: levels must be an integer >= 1, got {levels!r}")
        if levels >= (1 << 16):
            raise ValueError(f"QSGD: levels must be < 65536, got {levels!r}")
        self.levels = levels
        self.seed = int(seed)
        self.bits = _wire.code_width(levels + 1)

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        norm = tf.norm(flat)
        scaled = tf.math.divide_no_nan(tf.abs(flat), norm) * self.levels
        noise = tf.random.stateless_uniform(tf.shape(flat), _seed(step, self.seed + 31))
        level = tf.cast(tf.floor(scaled + noise), tf.int32)
        level = tf.minimum(level, self.levels)
        sign = tf.cast(flat < 0, tf.int32)
        return {
            "norm": tf.reshape(norm, [1]),
            "signs": _wire.pack_bits(sign, 1),
            "levels": _wire.pack_bits(level, self.bits),
        }, state

    def decompress(self, wire, shape, dtype=tf.float32):
        n = _num(shape)
        level = tf.cast(_wire.unpack_bits(wire["levels"], self.bits, n), tf.float32)
        sign = 1.0 - 2.0 * tf.cast(_wire.unpack_bits(wire["signs"], 1, n), tf.float32)
        return _restore(wire["norm"][0] * sign * level / self.levels, shape, dtype)

    def get_config(self):
        return {"levels": self.levels, "seed": self.seed}


@register
class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017): unbiased stochastic ternary ``{-s, 0, +s}``, ``s = max|g|``.

    Wire: the float32 scale and a 2-bit code per entry, 16 per int32 word.

    Example:
      >>> c = TernGrad(seed=0)
    """

    name = "terngrad"

    def __init__(self, seed: int = 0):
        self.seed = int(seed)

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        scale = tf.reduce_max(tf.abs(flat))
        prob = tf.math.divide_no_nan(tf.abs(flat), scale)
        keep = tf.random.stateless_uniform(tf.shape(flat), _seed(step, self.seed + 57)) < prob
        code = tf.where(keep, tf.where(flat < 0, 2, 1), 0)
        return {"scale": tf.reshape(scale, [1]), "codes": _wire.pack_bits(code, 2)}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        code = _wire.unpack_bits(wire["codes"], 2, _num(shape))
        value = tf.gather(tf.constant([0.0, 1.0, -1.0]), code) * wire["scale"][0]
        return _restore(value, shape, dtype)

    def get_config(self):
        return {"seed": self.seed}


class _SignBits(Compressor):
    """Shared sign packing: one bit per entry, 32 per int32 word."""

    @staticmethod
    def _signs(flat):
        return _wire.pack_bits(tf.cast(flat < 0, tf.int32), 1)

    @staticmethod
    def _unsign(words, n):
        return 1.0 - 2.0 * tf.cast(_wire.unpack_bits(words, 1, n), tf.float32)


@register
class SignSGD(_SignBits):
    """signSGD with majority vote (Bernstein et al. 2018): 1 bit per entry.

    Receivers decode each sender's signs as +-1 and aggregate by majority
    vote, ``sign(sum of signs)``, so the optimizer steps by ``lr * sign``.

    Example:
      >>> c = SignSGD()
    """

    name = "signsgd"

    def compress(self, grad, state, step):
        return {"signs": self._signs(_flat32(grad))}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        return _restore(self._unsign(wire["signs"], _num(shape)), shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        votes = tf.add_n([self._unsign(w["signs"], _num(shape)) for w in wires])
        return _restore(tf.sign(votes), shape, dtype)


@register
class ScaledSign(_SignBits):
    """Sign with one float32 scale, ``mean|g|`` (the compressor inside EF-SignSGD).

    Example:
      >>> c = ErrorFeedback(ScaledSign())   # == EFSignSGD()
    """

    name = "scaledsign"

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        scale = tf.reduce_mean(tf.abs(flat))
        return {"scale": tf.reshape(scale, [1]), "signs": self._signs(flat)}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        flat = self._unsign(wire["signs"], _num(shape)) * wire["scale"][0]
        return _restore(flat, shape, dtype)


def _wrapper_config(wrapper, default):
    """The config of an :class:`ErrorFeedback` subclass whose inner compressor
    defaults to a ``default()``: the inner one only when it is another."""
    config = ErrorFeedback.get_config(wrapper)
    if type(wrapper.compressor) is default:
        del config["compressor"]
    return config


def _wrapper_repr(wrapper, default):
    args = [] if type(wrapper.compressor) is default else [repr(wrapper.compressor)]
    if wrapper.min_size:
        args.append(f"min_size={wrapper.min_size}")
    return f"{type(wrapper).__name__}({', '.join(args)})"


@register
class EFSignSGD(ErrorFeedback):
    """EF-SignSGD (Karimireddy et al. 2019): scaled sign with error feedback.

    The scale is ``||p||_1 / d`` of the error-corrected gradient ``p``.
    ``min_size``: tensors with fewer elements are sent dense (see
    :class:`ErrorFeedback`).

    Example:
      >>> c = EFSignSGD()
      >>> c = EFSignSGD(min_size=1024)   # biases and small layers dense
    """

    def __init__(self, compressor: Compressor | dict | None = None, min_size: int = 0):
        super().__init__(ScaledSign() if compressor is None else compressor, min_size=min_size)
        self.name = "efsignsgd"

    def get_config(self):
        return _wrapper_config(self, ScaledSign)

    def __repr__(self):
        return _wrapper_repr(self, ScaledSign)


@register
class _OneBitQuantizer(_SignBits):
    name = "onebit_quantizer"

    def compress(self, grad, state, step):
        flat = _flat32(grad)
        neg = flat < 0
        pos_mean = tf.math.divide_no_nan(
            tf.reduce_sum(tf.where(neg, 0.0, flat)),
            tf.reduce_sum(tf.cast(tf.logical_not(neg), tf.float32)),
        )
        neg_mean = tf.math.divide_no_nan(
            tf.reduce_sum(tf.where(neg, flat, 0.0)), tf.reduce_sum(tf.cast(neg, tf.float32))
        )
        return {"means": tf.stack([pos_mean, neg_mean]), "signs": self._signs(flat)}, state

    def decompress(self, wire, shape, dtype=tf.float32):
        bits = _wire.unpack_bits(wire["signs"], 1, _num(shape))
        return _restore(tf.gather(wire["means"], bits), shape, dtype)


@register
class OneBit(ErrorFeedback):
    """1-bit SGD (Seide et al. 2014): 1 bit per entry with error feedback.

    Each entry is sent as its sign; the receiver reconstructs the mean of the
    positive entries or of the negative entries (two float32 on the wire).
    The quantisation error is carried to the next step. ``min_size``: tensors
    with fewer elements are sent dense (see :class:`ErrorFeedback`).

    Example:
      >>> c = OneBit()
      >>> c = OneBit(min_size=1024)
    """

    def __init__(self, compressor: Compressor | dict | None = None, min_size: int = 0):
        super().__init__(
            _OneBitQuantizer() if compressor is None else compressor, min_size=min_size
        )
        self.name = "onebit"

    def get_config(self):
        return _wrapper_config(self, _OneBitQuantizer)

    def __repr__(self):
        return _wrapper_repr(self, _OneBitQuantizer)


@register
class PowerSGD(Compressor):
    """PowerSGD (Vogels et al. 2019): rank-``rank`` approximation with error feedback.

    A gradient of rank >= 2 is viewed as a matrix ``M`` of shape
    ``(prod(shape[:-1]), shape[-1])``; one power iteration warm-started from
    the previous ``Q`` gives ``P = orth(M Q)``, ``Q = M^T P`` and the wire
    carries ``P`` and ``Q`` (float32). Vectors, and matrices too small to
    gain, go dense. The residual ``M - P Q^T`` is kept (error feedback).

    With :meth:`exchange`, the strategies run the paper's two-round
    protocol: the ``P`` of all replicas are summed before orthogonalisation
    and the ``Q`` are summed after, so the result is the rank-``rank``
    approximation of the summed gradient. :meth:`compress`/:meth:`decompress`
    alone (one push, e.g. to a parameter server) compress each sender on its own.

    Example:
      >>> c = PowerSGD(rank=2)
    """

    name = "powersgd"

    def __init__(self, rank: int = 2, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD: rank must be an integer >= 1, got {rank!r}")
        self.rank = rank
        self.seed = int(seed)

    def _matrix_shape(self, shape):
        shape = [int(d) for d in shape]
        if len(shape) < 2:
            return None
        n, m = _num(shape[:-1]), shape[-1]
        if self.rank * (n + m) >= n * m:
            return None
        return n, m

    def init(self, shape, dtype=tf.float32):
        self.check_dtype(dtype)
        state = {"residual": tf.zeros(shape, tf.float32)}
        nm = self._matrix_shape(shape)
        if nm is not None:
            state["q"] = tf.random.stateless_normal([nm[1], self.rank], [self.seed, nm[1]])
        return state

    def compress(self, grad, state, step):
        corrected = tf.cast(grad, tf.float32) + state["residual"]
        nm = self._matrix_shape(grad.shape)
        if nm is None:
            wire = {"values": tf.reshape(corrected, [-1])}
            return wire, {"residual": tf.zeros_like(corrected)}
        m = tf.reshape(corrected, nm)
        p = tf.linalg.qr(tf.matmul(m, state["q"]))[0]
        q = tf.matmul(m, p, transpose_a=True)
        approx = tf.reshape(tf.matmul(p, q, transpose_b=True), corrected.shape)
        return {"p": p, "q": q}, {"residual": corrected - approx, "q": q}

    def decompress(self, wire, shape, dtype=tf.float32):
        if "values" in wire:
            return _restore(wire["values"], shape, dtype)
        return _restore(tf.matmul(wire["p"], wire["q"], transpose_b=True), shape, dtype)

    def exchange(self, grads, states, step, all_sum):
        """Two-round PowerSGD over every gradient at once.

        ``all_sum(tensors)`` sums a list of tensors over replicas (one
        collective for the list). Round one sums every matrix's ``P`` and
        every vector whole; round two every ``Q``: two collectives per step
        whatever the number of tensors, as PyTorch's PowerSGD hook batches them.
        Returns ``(summed_grads, new_states, bytes_sent)``.
        """
        corrected = [tf.cast(g, tf.float32) + s["residual"] for g, s in zip(grads, states)]
        shapes = [self._matrix_shape(g.shape) for g in grads]
        matrices = [i for i, nm in enumerate(shapes) if nm is not None]
        vectors = [i for i, nm in enumerate(shapes) if nm is None]
        m = {i: tf.reshape(corrected[i], shapes[i]) for i in matrices}
        first = all_sum(
            [tf.matmul(m[i], states[i]["q"]) for i in matrices] + [corrected[i] for i in vectors]
        )
        totals, new_states = [None] * len(grads), [None] * len(grads)
        for i, total in zip(vectors, first[len(matrices) :]):
            totals[i] = total
            new_states[i] = {"residual": tf.zeros_like(corrected[i])}
        p = {i: tf.linalg.qr(p_sum)[0] for i, p_sum in zip(matrices, first)}
        q_local = {i: tf.matmul(m[i], p[i], transpose_a=True) for i in matrices}
        q_sum = all_sum([q_local[i] for i in matrices]) if matrices else []
        for i, q in zip(matrices, q_sum):
            local_approx = tf.matmul(p[i], q_local[i], transpose_b=True)
            totals[i] = tf.matmul(p[i], q, transpose_b=True)
            new_states[i] = {
                "residual": corrected[i] - tf.reshape(local_approx, corrected[i].shape),
                "q": q,
            }
        totals = [tf.cast(tf.reshape(t, g.shape), g.dtype) for t, g in zip(totals, grads)]
        words = sum(
            self.rank * (nm[0] + nm[1]) if nm else _num(g.shape) for g, nm in zip(grads, shapes)
        )
        return totals, new_states, tf.constant(4 * words, tf.int64)

    def get_config(self):
        return {"rank": self.rank, "seed": self.seed}


@register
class DGC(Compressor):
    """Deep Gradient Compression (Lin et al., ICLR 2018).

    Per sender and tensor: local gradient clipping, momentum correction (the
    momentum and the accumulated velocity live on the sender), top-k selection
    with DGC's sampled threshold on large tensors, momentum factor masking and
    an exponential warm-up of the density. Wire: float32 values + int32
    indices. Pair it with a plain (momentum-free) SGD optimizer: the compressed
    strategies refuse an optimizer with momentum of its own. The guide
    (``docs/api/guides/compression.rst``) has the update, the warm-up and what
    is sent dense.

    Args:
      sparsity: final fraction of entries *not* sent, in [0, 1).
      momentum: the momentum of the correction, in [0, 1).
      clip_norm: local L2 clipping threshold per tensor, or None.
      warmup_epochs: epochs of exponential sparsity warm-up (0: none).
      steps_per_epoch: optimizer steps per epoch for the warm-up; None: follow
        ``model.fit``'s epochs (outside ``fit``, give it).
      momentum_correction: accumulate momentum (True) or raw gradients
        (False: Gradient Dropping; the optimizer keeps its own momentum).
      min_size: tensors with fewer elements are sent dense (0: sparsify all).

    Example:
      >>> c = DGC(sparsity=0.999, momentum=0.9, clip_norm=5.0)  # warm-up: fit's epochs
      >>> c = DGC(sparsity=0.999, warmup_epochs=4, steps_per_epoch=100)  # a custom loop
      >>> c = DGC(sparsity=0.999, warmup_epochs=0, min_size=1024)   # biases dense
    """

    name = "dgc"

    def __init__(
        self,
        sparsity: float = 0.999,
        momentum: float = 0.9,
        clip_norm: float | None = None,
        warmup_epochs: int = 4,
        steps_per_epoch: int | None = None,
        momentum_correction: bool = True,
        min_size: int = 0,
    ):
        if (
            isinstance(sparsity, bool)
            or not isinstance(sparsity, (int, float))
            or not 0.0 <= sparsity < 1.0
        ):
            raise ValueError(f"DGC: sparsity must be a number in [0, 1), got {sparsity!r}")
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not 0.0 <= momentum < 1.0
        ):
            raise ValueError(f"DGC: momentum must be a number in [0, 1), got {momentum!r}")
        if clip_norm is not None:
            check_positive("DGC", "clip_norm", clip_norm)
        check_positive("DGC", "warmup_epochs", warmup_epochs, integer=True, allow_zero=True)
        if steps_per_epoch is not None:
            check_positive("DGC", "steps_per_epoch", steps_per_epoch, integer=True)
        self.sparsity = float(sparsity)
        self.momentum = float(momentum)
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.momentum_correction = bool(momentum_correction)
        self.min_size = check_positive("DGC", "min_size", min_size, integer=True, allow_zero=True)

    @property
    def follows_epochs(self):
        """True when the warm-up needs the epoch from ``compress(..., epoch=...)``."""
        return bool(self.warmup_epochs) and self.steps_per_epoch is None

    @property
    def applies_momentum(self):
        """True when the sender applies momentum (momentum correction)."""
        return self.momentum_correction and self.momentum > 0

    def is_dense(self, shape):
        """True when a gradient of ``shape`` has fewer than ``min_size`` elements (sent dense)."""
        return _num(shape) < self.min_size

    def init(self, shape, dtype=tf.float32):
        self.check_dtype(dtype)
        return {"u": tf.zeros([_num(shape)], tf.float32), "v": tf.zeros([_num(shape)], tf.float32)}

    def density(self, step, epoch=None):
        """Fraction of entries sent at optimizer step ``step`` of epoch ``epoch`` (float32 tensor).

        ``epoch`` (0-based) is needed during a warm-up without ``steps_per_epoch``.
        """
        final = tf.constant(1.0 - self.sparsity, tf.float32)
        if not self.warmup_epochs:
            return final
        if self.steps_per_epoch is not None:
            epoch = tf.cast(step, tf.int64) // self.steps_per_epoch
        elif epoch is None:
            raise ValueError(
                f"DGC: the warm-up (warmup_epochs={self.warmup_epochs}) needs to know where "
                "epochs end. model.fit under CompressedMirroredStrategy or "
                "CompressedMultiWorkerMirroredStrategy tells it; elsewhere pass "
                "DGC(steps_per_epoch=...) (optimizer steps per epoch) or warmup_epochs=0"
            )
        epoch = tf.cast(epoch, tf.int64)
        warm = tf.pow(0.25, tf.cast(epoch, tf.float32) + 1.0)
        return tf.where(epoch < self.warmup_epochs, tf.maximum(final, warm), final)

    def compress(self, grad, state, step, epoch=None):
        g = _flat32(grad)
        if self.clip_norm is not None:
            g = tf.clip_by_norm(g, self.clip_norm)
        if self.is_dense(grad.shape):
            if not self.momentum_correction:
                return {"values": g}, state
            u = self.momentum * state["u"] + g
            return {"values": u}, {"u": u, "v": state["v"]}
        if self.momentum_correction:
            u = self.momentum * state["u"] + g
            v = state["v"] + u
        else:
            u = state["u"]
            v = state["v"] + g
        n = g.shape[0]
        k = tf.maximum(tf.cast(tf.math.ceil(self.density(step, epoch) * n), tf.int32), 1)
        k = tf.minimum(k, n)
        idx = select_topk(tf.abs(v), k, _seed(step, 91))
        values = tf.gather(v, idx)
        where = tf.reshape(idx, [-1, 1])
        zeros = tf.zeros_like(values)
        v = tf.tensor_scatter_nd_update(v, where, zeros)
        if self.momentum_correction:
            u = tf.tensor_scatter_nd_update(u, where, zeros)
        return {"values": values, "indices": idx}, {"u": u, "v": v}

    def decompress(self, wire, shape, dtype=tf.float32):
        if self.is_dense(shape):
            return _restore(wire["values"], shape, dtype)
        return _sparse_decompress(wire, shape, dtype)

    def aggregate(self, wires, shape, dtype=tf.float32):
        if self.is_dense(shape):
            return _restore(tf.add_n([w["values"] for w in wires]), shape, dtype)
        return _sparse_aggregate(wires, shape, dtype)

    def get_config(self):
        return {
            "sparsity": self.sparsity,
            "momentum": self.momentum,
            "clip_norm": self.clip_norm,
            "warmup_epochs": self.warmup_epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "momentum_correction": self.momentum_correction,
            "min_size": self.min_size,
        }
