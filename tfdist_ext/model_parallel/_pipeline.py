"""GPipe-style micro-batch training step for a partitioned chain model (internal).

The batch is split into ``M`` micro-batches. For every micro-batch ``m`` and
stage ``s`` the forward pass runs under ``tf.device(stage s)`` in its own
``GradientTape``; the backward pass then runs stage by stage in reverse, also
under the stage's device, feeding each stage the gradient of its output. All
of this is one TensorFlow graph: TensorFlow's executor runs an op as soon as
its inputs are ready, so stage ``s`` works on micro-batch ``m`` while stage
``s+1`` works on micro-batch ``m-1`` -- the GPipe schedule falls out of the
data flow. Gradients are accumulated over micro-batches, weighted by
micro-batch size, so they equal the full-batch gradient (up to float32
summation order); the optimizer is applied once per step.
"""

import keras
import tensorflow as tf
from keras.src.trainers import data_adapters

_unpack = data_adapters.data_adapter_utils.unpack_x_y_sample_weight


def chain_layers(model):
    """The model's top-level layers if they form a single chain, else ``None``.

    A chain is a ``Sequential`` model or a functional model with one input and
    one output in which every layer takes exactly the previous layer's output.
    """
    from tfdist_ext.model_parallel._plan import top_level_layers

    layers = top_level_layers(model)
    if isinstance(model, keras.Sequential):
        return layers
    try:
        if len(model.inputs) != 1 or len(model.outputs) != 1:
            return None
        previous = model.inputs[0]
        for layer in layers:
            nodes = layer._inbound_nodes
            if len(nodes) != 1 or len(nodes[0].input_tensors) != 1:
                return None
            if nodes[0].input_tensors[0] is not previous:
                return None
            previous = layer.output
        return layers if model.outputs[0] is previous else None
    except (AttributeError, ValueError):
        return None


def _stages(layers, plan):
    stages = []
    for stage in plan.stages:
        members = [l for l in layers if l.name in stage.layers]
        stages.append((stage.device, members))
    return stages


def _call_layer(layer, h, training):
    if layer._call_has_training_arg:
        return layer(h, training=training)
    return layer(h)


def _split(value, sizes, num):
    if value is None:
        return [None] * num
    return tf.split(value, sizes, num=num, axis=0)


def microbatch_gradients(model, plan, data, microbatches):
    """Loss, predictions and gradients of one pipelined step (no update).

    Returns ``(loss, y_pred, grads)`` where ``grads`` lines up with
    ``model.trainable_variables``; ``loss`` is what the unpipelined Keras step
    would compute on the whole batch.

    Example:
      >>> loss, y_pred, grads = microbatch_gradients(model, plan, (x, y), 4)  # doctest: +SKIP
    """
    x, y, sample_weight = _unpack(data)
    layers = chain_layers(model)
    if layers is None:
        raise ValueError(f"model {model.name!r} is not a single chain of layers; "
                         "micro-batch pipelining needs one")
    stages = _stages(layers, plan)
    n = tf.shape(x)[0]
    tf.debugging.assert_greater_equal(
        n, microbatches,
        message=f"a batch must hold at least microbatches={microbatches} examples")
    base, extra = n // microbatches, n % microbatches
    sizes = tf.stack([base + tf.cast(m < extra, n.dtype) for m in range(microbatches)])
    xs = _split(x, sizes, microbatches)
    ys = tf.nest.map_structure(lambda t: _split(t, sizes, microbatches), y) \
        if y is not None else [None] * microbatches
    if y is not None and not isinstance(y, tf.Tensor):
        raise ValueError("micro-batch pipelining supports a single label tensor")
    sws = _split(sample_weight, sizes, microbatches)
    variables = model.trainable_variables
    total = tf.cast(n, tf.float32)

    tapes, outs, ins, preds, losses = {}, {}, {}, [], []
    for m in range(microbatches):
        h = xs[m]
        for s, (device, members) in enumerate(stages):
            with tf.device(device):
                h = tf.identity(h)
                with tf.GradientTape() as tape:
                    if s > 0:
                        tape.watch(h)
                    ins[s, m] = h
                    out = h
                    for layer in members:
                        out = _call_layer(layer, out, True)
                    if s == len(stages) - 1:
                        preds.append(out)
                        loss_m = model._compute_loss(
                            x=xs[m], y=ys[m], y_pred=out,
                            sample_weight=sws[m], training=True)
                        weight = tf.cast(sizes[m], loss_m.dtype) / tf.cast(total, loss_m.dtype)
                        losses.append(loss_m * weight)
                        out = losses[-1]
                        if model.optimizer is not None:
                            out = model.optimizer.scale_loss(out)
                tapes[s, m], outs[s, m] = tape, out
                h = out

    grads = [None] * len(variables)
    for m in range(microbatches):
        upstream = None
        for s in range(len(stages) - 1, -1, -1):
            device = stages[s][0]
            with tf.device(device):
                # The first stage needs no gradient for the model's input.
                head = [ins[s, m]] if s > 0 else []
                g = tapes[s, m].gradient(
                    outs[s, m], [*head, *variables],
                    output_gradients=None if upstream is None else [upstream],
                    unconnected_gradients=tf.UnconnectedGradients.NONE)
                upstream = g[0] if s > 0 else None
                for i, gv in enumerate(g[len(head):]):
                    if gv is None:
                        continue
                    if isinstance(gv, tf.IndexedSlices):
                        gv = tf.convert_to_tensor(gv)
                    grads[i] = gv if grads[i] is None else grads[i] + gv
    loss = tf.add_n(losses)
    y_pred = tf.concat(preds, axis=0)
    return loss, y_pred, grads


def pipelined_train_step(model, plan, microbatches, data):
    """Keras ``train_step`` semantics with micro-batch pipelining."""
    x, y, sample_weight = _unpack(data)
    loss, y_pred, grads = microbatch_gradients(model, plan, data, microbatches)
    model._loss_tracker.update_state(loss, sample_weight=tf.shape(x)[0])
    variables = model.trainable_variables
    if variables:
        model.optimizer.apply_gradients(zip(grads, variables))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
