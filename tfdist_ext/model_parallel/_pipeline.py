"""GPipe-style micro-batch training step for a partitioned chain model (internal).

The batch is split into ``M`` micro-batches. For every micro-batch ``m`` and
stage ``s`` the forward pass runs under ``tf.device(stage s)`` in its own
``GradientTape``; the backward pass then runs stage by stage in reverse, also
under the stage's device, feeding each stage the gradient of its output. All
of this is one TensorFlow graph: TensorFlow's executor runs an op as soon as
its inputs are ready, so stage ``s`` works on micro-batch ``m`` while stage
``s+1`` works on micro-batch ``m-1`` -- the GPipe schedule falls out of the
data flow. Gradients are accumulated over micro-batches; the loss is Keras' own
loss on the concatenated predictions, so the gradients equal the full-batch
gradient (up to float32 summation order); the optimizer is applied once per
step.
"""

import keras
import tensorflow as tf

from tfdist_ext import _integration

from tfdist_ext.model_parallel import _placement

_unpack = _integration.unpack_x_y_sample_weight


def chain_layers(model):
    """The model's top-level layers if they form a single chain, else ``None``.

    A chain is a ``Sequential`` model or a functional model with one input and
    one output in which every layer takes exactly the previous layer's output.

    Example:
      >>> [layer.name for layer in chain_layers(model)]  # doctest: +SKIP
      ['dense', 'dense_1']
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
    if _integration.call_has_training_arg(layer):
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
    computes on the whole batch. A batch may hold fewer examples than
    ``microbatches`` (a short last batch): the empty micro-batches cost
    nothing.

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
    base, extra = n // microbatches, n % microbatches
    sizes = tf.stack([base + tf.cast(m < extra, n.dtype) for m in range(microbatches)])
    xs = _split(x, sizes, microbatches)
    variables = model.trainable_variables
    last = len(stages) - 1

    # Forward: micro-batch m through stage s, each in its own tape, on the
    # stage's device. (A batch smaller than `microbatches` leaves some
    # micro-batches empty; empty tensors flow through harmlessly.)
    tapes, ins, outs = {}, {}, {}
    for m in range(microbatches):
        h = xs[m]
        for s, (device, members) in enumerate(stages):
            with tf.device(device):
                h = tf.identity(h)
                with tf.GradientTape() as tape:
                    if s > 0:  # the model's input needs no gradient
                        tape.watch(h)
                    out = h
                    for layer in members:
                        out = _call_layer(layer, out, True)
                tapes[s, m], ins[s, m], outs[s, m] = tape, h, out
                h = out

    # The loss is Keras' own loss on the whole batch (so any loss, weighted or
    # not, decomposable or not, is exactly the unpipelined one), computed on
    # the last stage's device once every micro-batch has come out -- the
    # GPipe schedule: all forwards, then all backwards.
    preds = [outs[last, m] for m in range(microbatches)]
    with tf.device(stages[last][0]):
        with tf.GradientTape() as tape:
            tape.watch(preds)
            y_pred = tf.concat(preds, axis=0)
            loss = _integration.compute_loss(model, x, y, y_pred, sample_weight)
            scaled = loss if model.optimizer is None else model.optimizer.scale_loss(loss)
        g = tape.gradient(scaled, [*preds, *variables],
                          unconnected_gradients=tf.UnconnectedGradients.NONE)
    upstreams = g[:microbatches]
    grads = list(g[microbatches:])  # e.g. weight regularisation terms

    # Backward: stage by stage in reverse, on each stage's device.
    for m in range(microbatches):
        upstream = upstreams[m]
        for s in range(last, -1, -1):
            # stage_gradients: the backward ops of a column-split layer's
            # shards go to the shards' devices, the rest to the stage's.
            with tf.device(stages[s][0]), _placement.stage_gradients():
                head = [ins[s, m]] if s > 0 else []
                g = tapes[s, m].gradient(
                    outs[s, m], [*head, *variables], output_gradients=[upstream],
                    unconnected_gradients=tf.UnconnectedGradients.NONE)
                upstream = g[0] if s > 0 else None
                for i, gv in enumerate(g[len(head):]):
                    if gv is None:
                        continue
                    if isinstance(gv, tf.IndexedSlices):
                        gv = tf.convert_to_tensor(gv)
                    grads[i] = gv if grads[i] is None else grads[i] + gv
    return loss, y_pred, grads


def pipelined_train_step(model, plan, microbatches, data):
    """Keras ``train_step`` semantics with micro-batch pipelining."""
    x, y, sample_weight = _unpack(data)
    loss, y_pred, grads = microbatch_gradients(model, plan, data, microbatches)
    _integration.loss_tracker(model).update_state(loss, sample_weight=tf.shape(x)[0])
    variables = model.trainable_variables
    if variables:
        model.optimizer.apply_gradients(zip(grads, variables))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
