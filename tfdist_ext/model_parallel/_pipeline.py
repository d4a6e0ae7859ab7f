"""GPipe-style micro-batch training step for a partitioned model (internal).

The model's layer graph, in a topological order (a ``Sequential`` model's
layers, or a functional model's call nodes), is cut into the plan's stages;
the tensors crossing a cut may be several (branches, skip connections that
span several stages). The batch is split into ``M`` micro-batches. For every
micro-batch ``m`` and stage ``s`` the forward pass runs under ``tf.device(stage
s)`` in its own ``GradientTape``, reading the tensors it needs from earlier
stages; the backward pass then runs stage by stage in reverse, also under the
stage's device, feeding each stage the summed gradients of the tensors it sent
on. All of this is one TensorFlow graph: TensorFlow's executor runs an op as
soon as its inputs are ready, so stage ``s`` works on micro-batch ``m`` while
stage ``s+1`` works on micro-batch ``m-1`` -- the GPipe schedule falls out of
the data flow. Gradients are accumulated over micro-batches; the loss is
Keras' own loss on the concatenated predictions, so the gradients equal the
full-batch gradient (up to float32 summation order); the optimizer is applied
once per step.
"""

import dataclasses

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.model_parallel import _placement
from tfdist_ext.model_parallel._plan import top_level_layers

_unpack = _integration.unpack_x_y_sample_weight


@dataclasses.dataclass
class _Call:
    """One layer call of the model graph: the tensor keys it reads and writes."""

    layer: keras.layers.Layer
    node: object  # a functional model's call node; None in a Sequential model
    inputs: list
    outputs: list

    def __call__(self, values, training):
        if self.node is None:
            args, kwargs = (values[self.inputs[0]],), {}
        else:
            args, kwargs = _integration.node_arguments(self.node, values)
        if _integration.call_has_training_arg(self.layer) and "training" not in kwargs:
            kwargs = {**kwargs, "training": training}
        outputs = keras.tree.flatten(self.layer(*args, **kwargs))
        values.update(zip(self.outputs, outputs))


@dataclasses.dataclass
class _Stage:
    device: str
    calls: list
    inputs: list  # keys of tensors from earlier stages (or the model's inputs)
    outputs: list  # keys of tensors later stages or the loss read


def pipeline_problem(model):
    """Why ``model``'s training step cannot be micro-batched, or ``None``.

    ``Sequential`` and functional models can; a subclassed model's graph is
    its Python ``call``, which cannot be cut into stages.

    Example:
      >>> pipeline_problem(keras.Sequential([keras.Input((4,)),
      ...                                    keras.layers.Dense(2)]))  # doctest: +SKIP
    """
    graph_call = (
        keras.Sequential.call
        if isinstance(model, keras.Sequential)
        else _integration.Functional.call
        if _integration.is_functional(model)
        else None
    )
    if graph_call is not None and type(model).call is graph_call:
        return None
    return (
        f"model {model.name!r} is a subclassed model ({type(model).__name__}) with "
        "its own call(), Python code that cannot be cut into pipeline stages"
    )


def batch_statistics_problem(model, microbatches):
    """Why ``microbatches`` would change ``model``'s training step, or ``None``.

    A ``BatchNormalization`` layer (or subclass) in training mode normalizes
    with the mean and variance of the batch it sees, and updates its moving
    statistics once per call: split into micro-batches, its outputs, the
    gradients and the moving statistics all differ from the whole batch's
    (GPipe's behaviour too, but here the promise is the unpipelined step). A
    frozen one (``trainable=False``) uses its moving statistics, per example.
    """
    if microbatches == 1:
        return None
    found = [
        f"{layer.name!r} ({type(layer).__name__})"
        for top in top_level_layers(model)
        for layer in _integration.sublayers(top)
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
    ]
    if not found:
        return None
    return (
        f"microbatches={microbatches} cannot train model {model.name!r}: layer(s) "
        f"{', '.join(found)} normalize with the statistics of the batch they see; each "
        f"micro-batch holds 1/{microbatches} of the batch, so the outputs, gradients and "
        "moving statistics would differ from the unpipelined step's. Use "
        "ModelParallelStrategy(..., microbatches=1) (the layers are still placed per "
        "stage), or normalize per example with LayerNormalization or GroupNormalization "
        "(or freeze the layer: trainable=False)."
    )


def _graph(model):
    """``(calls, input keys, output keys)`` of ``model``'s graph in a topological order."""
    if isinstance(model, keras.Sequential):
        layers = top_level_layers(model)
        calls = [_Call(layer, None, [i], [i + 1]) for i, layer in enumerate(layers)]
        return calls, [0], [len(layers)]
    calls = [
        _Call(layer, node, [id(t) for t in node.input_tensors], [id(t) for t in node.outputs])
        for layer, node in _integration.graph_nodes(model)
    ]
    return calls, [id(t) for t in model.inputs], [id(t) for t in model.outputs]


def _stages(model, plan):
    calls, model_inputs, model_outputs = _graph(model)
    order = {stage.device: s for s, stage in enumerate(plan.stages)}
    stage_of_layer = {name: order[device] for name, device in plan.layer_devices.items()}
    made_in = {key: -1 for key in model_inputs}
    by_stage = [[] for _ in plan.stages]
    for call in calls:
        # A call runs on the stage of its layer, or later if it reads a tensor
        # made later: a layer called at several places of the graph (a shared
        # layer) whose later call reads what a later stage's layer made. Its
        # ops still run next to its variables (apply_plan wraps the layer's
        # call in its device); its stage only decides when the call runs in
        # the pipeline and in which stage's tape, and the stages' variable
        # gradients are summed, so every call's share is counted once.
        # An operation that is not a layer (e.g. keras.ops.add in a functional
        # model) has no variables and is not planned: it follows its inputs.
        s = max([stage_of_layer.get(call.layer.name, 0), *(made_in.get(k, 0) for k in call.inputs)])
        made_in.update({key: s for key in call.outputs})
        by_stage[s].append(call)
    read_later = [set(model_outputs) for _ in by_stage]
    for s in range(len(by_stage) - 2, -1, -1):
        read_later[s] = read_later[s + 1] | {k for c in by_stage[s + 1] for k in c.inputs}
    stages = []
    for s, (stage, stage_calls) in enumerate(zip(plan.stages, by_stage)):
        made = {k for c in stage_calls for k in c.outputs}
        inputs = list(dict.fromkeys(k for c in stage_calls for k in c.inputs if k not in made))
        outputs = [
            k
            for k in dict.fromkeys(k for c in stage_calls for k in c.outputs)
            if k in read_later[s]
        ]
        stages.append(_Stage(stage.device, stage_calls, inputs, outputs))
    return stages, model_inputs, model_outputs


def _flat_inputs(model, x):
    if isinstance(x, dict) and not isinstance(model, keras.Sequential):
        return [x[t.name] for t in model.inputs]
    return keras.tree.flatten(x)


def _pack_outputs(model, flat):
    if isinstance(model, keras.Sequential) or len(flat) == 1:
        return flat[0]
    return keras.tree.pack_sequence_as(_integration.output_structure(model), flat)


def _carry(value):
    """``value`` on the current device, with its Keras mask (which a plain
    ``tf.identity`` would drop) carried along."""
    copy = tf.identity(value)
    mask = _integration.get_keras_mask(value)
    if mask is not None:
        _integration.set_keras_mask(copy, tf.identity(mask))
    return copy


def _concat(parts):
    """The micro-batches' outputs as one batch, with their Keras masks."""
    whole = tf.concat(parts, axis=0)
    masks = [_integration.get_keras_mask(p) for p in parts]
    if all(mask is not None for mask in masks):
        _integration.set_keras_mask(whole, tf.concat(masks, axis=0))
    return whole


def _add(total, value):
    if value is None:
        return total
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    return value if total is None else total + value


def microbatch_gradients(model, plan, data, microbatches):
    """Loss, predictions and gradients of one pipelined step (no update).

    Returns ``(loss, y_pred, grads)`` where ``grads`` lines up with
    ``model.trainable_variables``; ``loss`` is what the unpipelined Keras step
    computes on the whole batch. Works for ``Sequential`` and functional
    models (branches, skip connections and shared layers included). A batch
    may hold fewer examples than ``microbatches`` (a short last batch): the
    empty micro-batches cost nothing. Raises ``ValueError`` for a trainable
    ``BatchNormalization`` with ``microbatches > 1`` (see
    :func:`batch_statistics_problem`).

    Example:
      >>> loss, y_pred, grads = microbatch_gradients(model, plan, (x, y), 4)  # doctest: +SKIP
    """
    problem = pipeline_problem(model)
    if problem is not None:
        raise ValueError(
            f"micro-batch pipelining needs a Sequential or functional model: {problem}"
        )
    problem = batch_statistics_problem(model, microbatches)
    if problem is not None:
        raise ValueError(problem)
    x, y, sample_weight = _unpack(data)
    stages, model_inputs, model_outputs = _stages(model, plan)
    flat_x = _flat_inputs(model, x)
    n = tf.shape(flat_x[0])[0]
    base, extra = n // microbatches, n % microbatches
    sizes = tf.stack([base + tf.cast(m < extra, n.dtype) for m in range(microbatches)])
    split_x = [tf.split(v, sizes, num=microbatches, axis=0) for v in flat_x]
    variables = model.trainable_variables
    not_watched = set(model_inputs)  # the model's inputs need no gradient

    # Forward: micro-batch m through stage s, each in its own tape, on the
    # stage's device. (A batch smaller than `microbatches` leaves some
    # micro-batches empty; empty tensors flow through harmlessly.)
    # A layer's add_loss (or activity regularizer) adds a loss computed in its
    # stage's tape: `added` keeps them, and the backward pass sends them the
    # loss's gradient with respect to them.
    tapes, ins, outs, values, added = {}, {}, {}, [], {}
    for m in range(microbatches):
        values.append(dict(zip(model_inputs, (v[m] for v in split_x))))
        for s, stage in enumerate(stages):
            with tf.device(stage.device):
                local = {k: _carry(values[m][k]) for k in stage.inputs}
                added[s, m] = []
                with tf.GradientTape() as tape:
                    watched = [
                        k
                        for k in stage.inputs
                        if k not in not_watched and local[k].dtype.is_floating
                    ]
                    tape.watch([local[k] for k in watched])
                    for call in stage.calls:
                        call(local, True)
                        added[s, m] += _integration.added_losses(call.layer)
                tapes[s, m] = tape
                ins[s, m] = [(k, local[k]) for k in watched]
                outs[s, m] = [local[k] for k in stage.outputs]
                values[m].update(zip(stage.outputs, outs[s, m]))

    # The loss is Keras' own loss on the whole batch (so any loss, weighted or
    # not, decomposable or not, is exactly the unpipelined one), computed on
    # the last stage's device once every micro-batch has come out -- the
    # GPipe schedule: all forwards, then all backwards.
    _check_added_losses(added, stages, microbatches)
    preds = [[values[m][k] for k in model_outputs] for m in range(microbatches)]
    flat_preds = [p for per_m in preds for p in per_m]
    flat_added = [t for s in range(len(stages)) for t in added[s, 0]]
    with tf.device(stages[-1].device):
        with tf.GradientTape() as tape:
            # Keras's loss adds model.losses: the layers' added losses are
            # those very tensors, computed in the stages' tapes.
            tape.watch(flat_preds + flat_added)
            y_pred = _pack_outputs(
                model,
                [
                    _concat([preds[m][i] for m in range(microbatches)])
                    for i in range(len(model_outputs))
                ],
            )
            loss = _integration.compute_loss(model, x, y, y_pred, sample_weight)
            scaled = loss if model.optimizer is None else model.optimizer.scale_loss(loss)
        g = tape.gradient(
            scaled,
            [*flat_preds, *flat_added, *variables],
            unconnected_gradients=tf.UnconnectedGradients.NONE,
        )
    k = len(model_outputs)
    upstream = [dict(zip(model_outputs, g[m * k : (m + 1) * k])) for m in range(microbatches)]
    added_grads = iter(g[len(flat_preds) : len(flat_preds) + len(flat_added)])
    added_grads = {s: [next(added_grads) for _ in added[s, 0]] for s in range(len(stages))}
    grads = list(g[len(flat_preds) + len(flat_added) :])  # e.g. weight regularisation terms

    # Backward: stage by stage in reverse, on each stage's device; a tensor
    # read by several later stages gets the sum of their gradients.
    for m in range(microbatches):
        for s in range(len(stages) - 1, -1, -1):
            stage = stages[s]
            if not stage.outputs and not added[s, m]:
                continue
            # stage_gradients: the backward ops of a column-split layer's
            # shards go to the shards' devices, the rest to the stage's.
            with tf.device(stage.device), _placement.stage_gradients():
                output_gradients = [
                    upstream[m].get(key) if upstream[m].get(key) is not None else tf.zeros_like(out)
                    for key, out in zip(stage.outputs, outs[s, m])
                ]
                # Added losses: only with one micro-batch (_check_added_losses).
                output_gradients += [
                    tf.zeros_like(t) if gt is None else gt
                    for t, gt in zip(added[s, m], added_grads[s])
                ]
                head = ins[s, m]
                g = tapes[s, m].gradient(
                    outs[s, m] + added[s, m],
                    [h for _, h in head] + variables,
                    output_gradients=output_gradients,
                    unconnected_gradients=tf.UnconnectedGradients.NONE,
                )
                for (key, _), gk in zip(head, g[: len(head)]):
                    upstream[m][key] = _add(upstream[m].get(key), gk)
                for i, gv in enumerate(g[len(head) :]):
                    grads[i] = _add(grads[i], gv)
    return loss, y_pred, grads


def _check_added_losses(added, stages, microbatches):
    """Refuses losses added by layers (``add_loss``) when the batch is split.

    Such a loss is whatever the layer computes from the batch it sees (a
    mean, a sum, anything), so no combination of its micro-batch values is
    the whole batch's in general; with one micro-batch it is exact.
    """
    if microbatches == 1 or not any(added.values()):
        return
    layers = sorted(
        {
            call.layer.name
            for stage in stages
            for call in stage.calls
            if _integration.added_losses(call.layer)
        }
    )
    raise ValueError(
        f"ModelParallelStrategy(microbatches={microbatches}): layer(s) "
        f"{', '.join(layers) or '(unnamed)'} add a loss in call() (add_loss or an "
        "activity_regularizer), computed from the batch the layer sees; split into "
        "micro-batches it would not be the whole batch's loss. Use microbatches=1 "
        "(the layers are still placed per stage), or move the term into compute_loss."
    )


def pipelined_train_step(model, plan, microbatches, data):
    """Keras ``train_step`` semantics with micro-batch pipelining."""
    x, y, sample_weight = _unpack(data)
    loss, y_pred, grads = microbatch_gradients(model, plan, data, microbatches)
    _integration.loss_tracker(model).update_state(
        loss, sample_weight=tf.shape(keras.tree.flatten(x)[0])[0]
    )
    variables = model.trainable_variables
    if variables:
        model.optimizer.apply_gradients(zip(grads, variables))
    return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
