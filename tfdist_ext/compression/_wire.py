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


def _words(t):
    """A flat float32 or int32 tensor as int32 words (float32 bitcast, bits unchanged)."""
    flat = tf.reshape(t, [-1])
    if flat.dtype == tf.float32:
        return tf.bitcast(flat, tf.int32)
    if flat.dtype == tf.int32:
        return flat
    raise TypeError(f"wire tensors must be float32 or int32, got {flat.dtype.name}")


def pack(tensors):
    """One flat int32 buffer holding ``tensors`` (float32 or int32), for one collective.

    Layout: the lengths of the tensors whose shape is not static (the receiver
    knows the others'), then every tensor's words in order. The bytes are the
    payload plus 4 per variable-length tensor, as separate sends would need.
    """
    words = [_words(t) for t in tensors]
    lengths = [
        tf.reshape(tf.size(w, out_type=tf.int32), [1])
        for t, w in zip(tensors, words)
        if not t.shape.is_fully_defined()
    ]
    return tf.concat(lengths + words, 0)


def unpack(gathered, like, senders):
    """Inverse of :func:`pack` over the all-gather of ``senders`` buffers.

    ``like``: the tensors one sender packed (their dtypes and static shapes).
    Returns, per sender, its tensors in order, shaped and typed as ``like``.
    """
    dynamic = [not t.shape.is_fully_defined() for t in like]
    num_dynamic = sum(dynamic)
    out, offset = [], 0
    for _ in range(senders):
        header = iter(tf.unstack(gathered[offset : offset + num_dynamic], num=num_dynamic))
        sizes = tf.stack(
            [next(header) if d else t.shape.num_elements() for t, d in zip(like, dynamic)]
        )
        start = offset + num_dynamic
        end = start + tf.reduce_sum(sizes)
        parts = tf.split(gathered[start:end], sizes, num=len(like))
        tensors = []
        for part, t in zip(parts, like):
            if t.dtype == tf.float32:
                part = tf.bitcast(part, tf.float32)
            tensors.append(tf.reshape(part, t.shape) if t.shape.is_fully_defined() else part)
        out.append(tensors)
        offset = end
    return out
