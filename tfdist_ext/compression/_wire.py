"""Wire-form helpers: bit packing into int32 words, half floats, byte counts (internal).

Everything that crosses a device or process boundary is packed into tensors of
dtype ``float32`` or ``int32`` (the dtypes every TensorFlow collective and
cross-device copy supports), so the bytes counted are the bytes moved.
"""

import tensorflow as tf

_PACK_WIDTHS = (1, 2, 4, 8, 16)


def code_width(num_codes):
    """Smallest packing width in bits (1, 2, 4, 8 or 16) holding ``num_codes`` codes."""
    for bits in _PACK_WIDTHS:
        if num_codes <= (1 << bits):
            return bits
    raise ValueError(f"cannot pack {num_codes} distinct codes into <= 16 bits")


def pack_bits(codes, bits):
    """Packs a flat int32 tensor of codes in ``[0, 2**bits)`` into int32 words.

    ``32 // bits`` codes share a word; the tail is zero-padded.
    """
    per_word = 32 // bits
    codes = tf.cast(tf.reshape(codes, [-1]), tf.int32)
    pad = (-tf.size(codes)) % per_word
    codes = tf.reshape(tf.pad(codes, [[0, pad]]), [-1, per_word])
    shifts = tf.range(per_word, dtype=tf.int32) * bits
    # Disjoint bit fields: the sum is the bitwise OR (no carries).
    return tf.reduce_sum(tf.bitwise.left_shift(codes, shifts), axis=1)


def unpack_bits(words, bits, n):
    """Inverse of :func:`pack_bits`: the first ``n`` codes as int32."""
    per_word = 32 // bits
    shifts = tf.range(per_word, dtype=tf.int32) * bits
    mask = tf.constant((1 << bits) - 1, tf.int32)
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.reshape(words, [-1, 1]), shifts), mask)
    return tf.reshape(codes, [-1])[:n]


def pack_half(x, dtype):
    """Casts a flat float tensor to a 16-bit ``dtype`` and packs pairs into int32 words."""
    half = tf.cast(tf.reshape(x, [-1]), dtype)
    pad = tf.size(half) % 2
    half = tf.reshape(tf.pad(half, [[0, pad]]), [-1, 2])
    return tf.bitcast(half, tf.int32)


def unpack_half(words, dtype, n):
    """Inverse of :func:`pack_half`: the first ``n`` values as ``float32``."""
    half = tf.reshape(tf.bitcast(words, dtype), [-1])[:n]
    return tf.cast(half, tf.float32)


def wire_bytes(wire):
    """Bytes of a wire nest: sum over its tensors of ``size * itemsize`` (int64 tensor)."""
    total = tf.constant(0, tf.int64)
    for t in tf.nest.flatten(wire):
        total += tf.cast(tf.size(t), tf.int64) * tf.as_dtype(t.dtype).size
    return total


def static_num_elements(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n
