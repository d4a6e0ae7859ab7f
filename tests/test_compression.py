"""Compressors: wire forms, reconstruction, state, error feedback, validation."""

import numpy as np
import pytest
import tensorflow as tf

from tfdist_ext import compression as C
from tfdist_ext.compression import _compressors
from tfdist_ext.compression import _wire

pytestmark = pytest.mark.timeout(120)


def _grad(shape=(40, 25), seed=0):
    return tf.constant(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def _compress(c, g, state=None, step=0):
    state = c.init(g.shape) if state is None else state
    return c.compress(g, state, tf.constant(step, tf.int64))


def _dtypes(wire):
    return {t.dtype for t in tf.nest.flatten(wire)}


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
def test_pack_bits_roundtrip(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, size=1001).astype(np.int32)
    words = _wire.pack_bits(codes, bits)
    assert words.dtype == tf.int32
    assert words.shape[0] == -(-1001 // (32 // bits))
    np.testing.assert_array_equal(_wire.unpack_bits(words, bits, 1001), codes)


def test_pack_and_unpack_one_buffer_for_every_wire_tensor():
    """float32 bits (NaN, -0.0) and int32 survive; lengths only for variable-length tensors."""
    floats = tf.constant([1.5, -0.0, float("nan"), 3e-41], tf.float32)
    ints = tf.constant([[7, -1], [0, 2**31 - 1]], tf.int32)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32)])
    def roundtrip(dynamic):
        like = [floats, dynamic, ints]
        buffer = _wire.pack(like)
        # Two senders: the gather's output is their buffers end to end.
        return buffer, _wire.unpack(tf.concat([buffer, buffer], 0), like, 2)

    buffer, senders = roundtrip(tf.constant([5, 6, 7], tf.int32))
    assert buffer.dtype == tf.int32 and buffer.shape == [1 + 4 + 3 + 4]  # 1 length
    for floats_out, dynamic_out, ints_out in senders:
        np.testing.assert_array_equal(
            tf.bitcast(floats_out, tf.int32), tf.bitcast(floats, tf.int32)
        )
        np.testing.assert_array_equal(dynamic_out, [5, 6, 7])
        np.testing.assert_array_equal(ints_out, ints)
    with pytest.raises(TypeError, match="float32 or int32"):
        _wire.pack([tf.ones([2], tf.float16)])


def test_no_compression_is_exact_and_dense():
    g = _grad()
    wire, _ = _compress(C.NoCompression(), g)
    assert int(C.NoCompression().wire_bytes(wire)) == 4 * 1000
    np.testing.assert_array_equal(C.NoCompression().decompress(wire, g.shape), g)


@pytest.mark.parametrize("cls,dtype,rtol", [(C.FP16, np.float16, 1e-3), (C.BF16, "bf16", 1e-2)])
def test_half_precision_halves_the_bytes(cls, dtype, rtol):
    g = _grad((7, 11))  # odd size: padded to whole int32 words
    wire, _ = _compress(cls(), g)
    assert _dtypes(wire) == {tf.int32}
    assert int(cls().wire_bytes(wire)) == 4 * 39  # ceil(77 / 2) words
    out = cls().decompress(wire, g.shape)
    if dtype == np.float16:
        np.testing.assert_array_equal(out, g.numpy().astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(out, g, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("cls,wire_dtype", [(C.FP16, tf.float16), (C.BF16, tf.bfloat16)])
def test_half_precision_sums_in_its_own_dtype(cls, wire_dtype):
    """The strategies' exchange: one all-reduce of the 16-bit gradients (Horovod's fp16)."""
    grads = [_grad((7, 11)), _grad((5,))]
    summed_dtypes = []

    def all_sum(tensors):  # two senders with the same gradients
        summed_dtypes.extend(t.dtype for t in tensors)
        return [t + t for t in tensors]

    totals, states, sent = cls().exchange(grads, [{}, {}], 0, all_sum)
    assert summed_dtypes == [wire_dtype, wire_dtype] and states == [{}, {}]
    assert int(sent) == 2 * (77 + 5)
    for total, g in zip(totals, grads):
        half = tf.cast(g, wire_dtype)
        assert total.dtype == tf.float32 and total.shape == g.shape
        np.testing.assert_array_equal(total, tf.cast(half + half, tf.float32))


def test_topk_keeps_exactly_the_largest_entries():
    g = _grad()
    c = C.TopK(0.01)
    wire, _ = _compress(c, g)
    assert wire["indices"].dtype == tf.int32 and wire["values"].shape == (10,)
    assert int(c.wire_bytes(wire)) == 10 * 8
    out = c.decompress(wire, g.shape).numpy().ravel()
    flat = g.numpy().ravel()
    top = np.argsort(-np.abs(flat))[:10]
    np.testing.assert_array_equal(np.flatnonzero(out), np.sort(top))
    np.testing.assert_array_equal(out[top], flat[top])


@pytest.mark.parametrize("density", [0.001, 0.01, 0.25])
def test_topk_sampled_threshold_on_large_tensors(density):
    n = _compressors.EXACT_TOPK_LIMIT * 2
    x = tf.abs(tf.random.stateless_normal([n], [1, 2]))
    k = int(n * density)
    exact = np.sort(x.numpy())[-k:]
    for step in range(5):
        idx = _compressors.select_topk(x, k, _compressors._seed(step, 91)).numpy()
        assert len(set(idx.tolist())) == len(idx) == k
        # The threshold is set low enough that the candidates hold the true top k.
        np.testing.assert_array_equal(np.sort(x.numpy()[idx]), exact)


def test_randomk_sends_only_values_and_a_seed():
    g = _grad()
    c = C.RandomK(0.05, seed=3)
    wire, _ = _compress(c, g, step=7)
    assert set(wire) == {"values", "seed"}
    assert int(c.wire_bytes(wire)) == 50 * 4 + 8
    out = c.decompress(wire, g.shape).numpy().ravel()
    nz = np.flatnonzero(out)
    assert len(nz) == 50
    np.testing.assert_array_equal(out[nz], g.numpy().ravel()[nz])
    other, _ = _compress(c, g, step=8)  # another step, other indices
    assert not np.array_equal(np.flatnonzero(c.decompress(other, g.shape).numpy().ravel()), nz)


def test_threshold_sends_everything_above_tau():
    g = _grad()
    c = C.Threshold(1.5)
    wire, _ = _compress(c, g)
    flat = g.numpy().ravel()
    expected = np.where(np.abs(flat) >= 1.5, flat, 0.0)
    np.testing.assert_array_equal(c.decompress(wire, g.shape).numpy().ravel(), expected)
    assert int(c.wire_bytes(wire)) == 8 * int((np.abs(flat) >= 1.5).sum())


def test_qsgd_is_unbiased_and_packed():
    g = _grad((64,))
    c = C.QSGD(levels=4)
    outs = []
    for step in range(400):
        wire, _ = _compress(c, g, step=step)
        outs.append(c.decompress(wire, g.shape).numpy())
    # 1 sign bit + 4 bits of level (5 codes) per entry, plus the norm.
    assert int(c.wire_bytes(wire)) == 4 * (2 + 8 + 1)
    norm = np.linalg.norm(g.numpy())
    levels = np.unique(np.round(np.abs(np.stack(outs)) / norm * 4, 4))
    assert set(levels) <= {0.0, 1.0, 2.0, 3.0, 4.0}
    np.testing.assert_allclose(np.mean(outs, 0), g.numpy(), atol=0.35)


def test_terngrad_is_ternary_and_unbiased():
    g = _grad((64,))
    c = C.TernGrad()
    outs = []
    for step in range(400):
        wire, _ = _compress(c, g, step=step)
        outs.append(c.decompress(wire, g.shape).numpy())
    assert int(c.wire_bytes(wire)) == 4 * (1 + 4)  # scale + 64 two-bit codes
    s = np.abs(g.numpy()).max()
    assert set(np.unique(np.round(np.stack(outs) / s, 5))) <= {-1.0, 0.0, 1.0}
    np.testing.assert_allclose(np.mean(outs, 0), g.numpy(), atol=0.3)


def test_signsgd_majority_vote():
    c = C.SignSGD()
    a = tf.constant([1.0, -2.0, 3.0, -4.0])
    b = tf.constant([1.0, 2.0, -3.0, -4.0])
    d = tf.constant([-1.0, 2.0, -3.0, -4.0])
    wires = [_compress(c, x)[0] for x in (a, b, d)]
    assert int(c.wire_bytes(wires[0])) == 4
    np.testing.assert_array_equal(c.decompress(wires[0], (4,)), [1, -1, 1, -1])
    np.testing.assert_array_equal(c.aggregate(wires, (4,)), [1, 1, -1, -1])


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.ErrorFeedback(C.TopK(0.05)),
        lambda: C.OneBit(),
        lambda: C.EFSignSGD(),
        lambda: C.ErrorFeedback(C.RandomK(0.1)),
        lambda: C.PowerSGD(rank=1),
    ],
)
def test_error_feedback_loses_nothing(make):
    """sum(sent) + residual == sum(gradients), whatever was dropped."""
    c = make()
    state = c.init((30, 20))
    sent = np.zeros((30, 20), np.float32)
    total = np.zeros((30, 20), np.float32)
    for step in range(5):
        g = _grad((30, 20), seed=step)
        wire, state = c.compress(g, state, tf.constant(step, tf.int64))
        sent += c.decompress(wire, g.shape).numpy()
        total += g.numpy()
    np.testing.assert_allclose(sent + state["residual"].numpy(), total, atol=1e-4)
    assert np.abs(state["residual"].numpy()).sum() > 0


def test_onebit_reconstructs_the_two_means():
    g = tf.constant([1.0, 3.0, -2.0, -4.0, 2.0])
    wire, _ = _compress(C.OneBit(), g)
    np.testing.assert_allclose(C.OneBit().decompress(wire, (5,)), [2, 2, -3, -3, 2])
    assert int(C.OneBit().wire_bytes(wire)) == 4 + 8


def test_powersgd_is_low_rank_and_exact_on_low_rank_input():
    rng = np.random.default_rng(0)
    m = (rng.normal(size=(50, 2)) @ rng.normal(size=(2, 40))).astype(np.float32)
    c = C.PowerSGD(rank=2)
    wire, state = _compress(c, tf.constant(m))
    assert set(wire) == {"p", "q"} and wire["p"].shape == (50, 2) and wire["q"].shape == (40, 2)
    assert int(c.wire_bytes(wire)) == 4 * 2 * (50 + 40)
    out = c.decompress(wire, m.shape).numpy()
    assert np.linalg.matrix_rank(out, tol=1e-3) <= 2
    np.testing.assert_allclose(out, m, atol=1e-3)
    # Vectors are sent dense.
    bias_wire, _ = _compress(c, tf.ones([40]))
    assert set(bias_wire) == {"values"}


def _dgc_reference(grads, density, momentum, clip):
    """NumPy DGC (Lin et al., Algorithm 1 with momentum correction and factor masking)."""
    u = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    sent = []
    for g in grads:
        norm = np.linalg.norm(g)
        if clip and norm > clip:
            g = g * clip / norm
        u = momentum * u + g
        v = v + u
        k = max(1, int(np.ceil(density * g.size)))
        idx = np.argsort(-np.abs(v))[:k]
        out = np.zeros_like(v)
        out[idx] = v[idx]
        v[idx] = 0.0
        u[idx] = 0.0
        sent.append(out)
    return sent, u, v


def test_dgc_matches_the_paper_algorithm():
    grads = [np.random.default_rng(s).normal(size=200).astype(np.float32) for s in range(6)]
    c = C.DGC(sparsity=0.95, momentum=0.9, clip_norm=10.0, warmup_epochs=0)
    state = c.init((200,))
    sent = []
    for step, g in enumerate(grads):
        wire, state = c.compress(tf.constant(g), state, tf.constant(step, tf.int64))
        assert int(c.wire_bytes(wire)) == 10 * 8
        sent.append(c.decompress(wire, (200,)).numpy())
    ref, u, v = _dgc_reference(grads, 0.05, 0.9, 10.0)
    np.testing.assert_allclose(np.stack(sent), np.stack(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state["u"], u, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state["v"], v, rtol=1e-5, atol=1e-5)


def test_dgc_exponential_warmup():
    c = C.DGC(sparsity=0.999, warmup_epochs=4, steps_per_epoch=10)
    densities = [float(c.density(step)) for step in (0, 9, 10, 20, 30, 40, 1000)]
    np.testing.assert_allclose(
        densities, [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001], rtol=1e-5
    )


def test_dgc_warmup_follows_the_epoch_it_is_given():
    c = C.DGC(sparsity=0.999)  # the defaults: 4 warm-up epochs, no steps_per_epoch
    assert c.follows_epochs and c.applies_momentum
    densities = [float(c.density(step=7, epoch=e)) for e in range(6)]
    np.testing.assert_allclose(
        densities, [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001], rtol=1e-5
    )
    wire, _ = c.compress(tf.range(100.0), c.init((100,)), step=0, epoch=1)
    assert wire["values"].shape == [7]  # ceil(0.0625 * 100)
    # Without fit to say where epochs end, it says what to pass instead.
    with pytest.raises(ValueError, match=r"warmup_epochs=4.*DGC\(steps_per_epoch=\.\.\.\)"):
        c.compress(tf.range(100.0), c.init((100,)), step=0)
    assert not C.DGC(steps_per_epoch=10).follows_epochs
    assert C.ErrorFeedback(C.DGC()).follows_epochs


def test_dgc_without_momentum_correction_accumulates_gradients():
    c = C.DGC(sparsity=0.5, momentum=0.9, warmup_epochs=0, momentum_correction=False)
    state = c.init((4,))
    wire, state = c.compress(tf.constant([4.0, -3.0, 1.0, 0.5]), state, tf.constant(0, tf.int64))
    np.testing.assert_allclose(c.decompress(wire, (4,)), [4.0, -3.0, 0.0, 0.0])
    np.testing.assert_allclose(state["v"], [0.0, 0.0, 1.0, 0.5])
    np.testing.assert_allclose(state["u"], 0.0)


def test_compressors_work_inside_tf_function():
    c = C.ErrorFeedback(C.TopK(0.1))
    state = c.init((100,))

    @tf.function
    def step(g, state, i):
        wire, state = c.compress(g, state, i)
        return c.decompress(wire, (100,)), state

    out, state = step(tf.ones([100]), state, tf.constant(0, tf.int64))
    assert int(tf.math.count_nonzero(out)) == 10


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: C.TopK(0.0), "ratio must be a number in \\(0, 1\\]"),
        (lambda: C.TopK(1.5), "ratio"),
        (lambda: C.RandomK(-0.1), "ratio"),
        (lambda: C.QSGD(levels=0), "levels must be an integer >= 1"),
        (lambda: C.PowerSGD(rank=0), "rank"),
        (lambda: C.Threshold(0), "tau"),
        (lambda: C.DGC(sparsity=1.0, warmup_epochs=0), "sparsity"),
        (lambda: C.DGC(momentum=1.2, warmup_epochs=0), "momentum"),
        (lambda: C.ErrorFeedback("topk"), "must be a tfdist_ext.compression.Compressor"),
        (lambda: C.get("zip"), "unknown compressor"),
        (lambda: C.TopK(0.1).init((3,), tf.int32), "unsupported gradient dtype int32"),
        (lambda: C.DGC(warmup_epochs=0, min_size=-1), "min_size must be an integer >= 0"),
        (lambda: C.ErrorFeedback(C.TopK(0.1), min_size=1.5), "min_size must be an integer"),
        (lambda: C.OneBit(min_size="big"), "min_size"),
        (lambda: C.CompressedMirroredStrategy(["/cpu:0"], compression=42), "compression must be"),
    ],
)
def test_bad_configuration_raises_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "c",
    [
        C.TopK(0.02),
        C.RandomK(0.1, seed=4),
        C.QSGD(8),
        C.DGC(warmup_epochs=2, steps_per_epoch=5),
        C.ErrorFeedback(C.TopK(0.3)),
        C.PowerSGD(4),
        C.OneBit(),
        C.EFSignSGD(),
        C.FP16(),
        C.ErrorFeedback(C.RandomK(0.1), min_size=64),
        C.OneBit(min_size=8),
        C.EFSignSGD(min_size=8),
        C.DGC(warmup_epochs=0, min_size=1024),
    ],
)
def test_config_roundtrip(c):
    import keras

    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(c))
    assert type(again) is type(c) and again.get_config() == c.get_config()
    assert repr(again) == repr(c)


def test_get_by_name():
    assert isinstance(C.get("ef_topk", ratio=0.1), C.ErrorFeedback)
    assert C.get("qsgd", levels=2).levels == 2


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.ErrorFeedback(C.TopK(0.1), min_size=50),
        lambda: C.OneBit(min_size=50),
        lambda: C.EFSignSGD(min_size=50),
        lambda: C.DGC(sparsity=0.9, warmup_epochs=0, min_size=50, momentum_correction=False),
    ],
)
def test_min_size_sends_small_tensors_dense_and_compresses_the_rest(make):
    c = make()
    small, large = _grad((7, 7), seed=1), _grad((10, 10), seed=2)  # 49 < 50 <= 100
    wire, state = _compress(c, small)
    assert list(wire) == ["values"] and int(c.wire_bytes(wire)) == 4 * 49
    np.testing.assert_array_equal(c.decompress(wire, small.shape), small)
    np.testing.assert_array_equal(c.aggregate([wire, wire], small.shape), 2 * small)
    assert not any(np.abs(v.numpy()).sum() for v in tf.nest.flatten(state))
    wire, _ = _compress(c, large)
    assert int(c.wire_bytes(wire)) < 4 * 100 / 4


def test_dgc_min_size_is_momentum_sgd_on_small_tensors():
    c = C.DGC(sparsity=0.99, momentum=0.9, warmup_epochs=0, min_size=10)
    state, u = c.init((4,)), np.zeros(4)
    for step in range(3):
        g = _grad((4,), seed=step)
        wire, state = c.compress(g, state, step)
        u = 0.9 * u + g.numpy()
        np.testing.assert_allclose(c.decompress(wire, (4,)), u, rtol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: C.TopK(0.3),
        lambda: C.Threshold(1.0),
        lambda: C.DGC(sparsity=0.7, warmup_epochs=0, momentum_correction=False),
    ],
)
def test_sparse_aggregate_sums_every_senders_entries_where_they_coincide(make):
    c = make()
    base = _grad((10, 10), seed=3)
    # Three senders: two share most of their largest entries, one has none
    # above Threshold's tau (an empty wire).
    grads = [base, base + 0.01 * _grad((10, 10), seed=4), 0.001 * _grad((10, 10), seed=5)]
    wires = [_compress(c, g)[0] for g in grads]
    expected = sum(c.decompress(w, base.shape).numpy() for w in wires)
    shared = set(wires[0]["indices"].numpy()) & set(wires[1]["indices"].numpy())
    assert shared  # the case that needs summing
    np.testing.assert_allclose(c.aggregate(wires, base.shape), expected, rtol=1e-6)
    traced = tf.function(lambda ws: c.aggregate(ws, base.shape, tf.float16))(wires)
    assert traced.dtype == tf.float16 and traced.shape == base.shape
    np.testing.assert_allclose(traced.numpy(), expected, rtol=1e-3, atol=1e-3)


def test_randomk_aggregate_is_the_sum_of_its_senders_decompressions():
    c = C.RandomK(0.3, seed=1)
    grads = [_grad((10, 10), seed=s) for s in (6, 7, 8)]
    wires = [_compress(c, g, step=3)[0] for g in grads]  # same step: same indices
    expected = sum(c.decompress(w, (10, 10)).numpy() for w in wires)
    np.testing.assert_array_equal(c.aggregate(wires, (10, 10)), expected)
    np.testing.assert_array_equal(
        c.aggregate(wires[:1], (10, 10)), c.decompress(wires[0], (10, 10))
    )
