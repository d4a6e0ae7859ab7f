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
    _check_pipelinable(model, microbatches)
    x, y, sample_weight = _unpack(data)
    pipeline = _Pipeline(model, plan, microbatches)
    pipeline.forward(_split_batch(_flat_inputs(model, x), microbatches))
    loss, y_pred = pipeline.loss(x, y, sample_weight)
    return loss, y_pred, pipeline.backward()


def _check_pipelinable(model, microbatches):
    """Refuses, before any op is made, a model the pipeline cannot run exactly."""
    problem = pipeline_problem(model)
    if problem is not None:
        raise ValueError(
            f"micro-batch pipelining needs a Sequential or functional model: {problem}"
        )
    problem = batch_statistics_problem(model, microbatches)
    if problem is not None:
        raise ValueError(problem)


def _split_batch(flat_x, microbatches):
    """Each input split into ``microbatches`` parts along the batch axis.

    The sizes differ by at most one, so any batch size works; a batch smaller
    than ``microbatches`` leaves some parts empty, and empty tensors flow
    through the stages harmlessly.
    """
    n = tf.shape(flat_x[0])[0]
    base, extra = n // microbatches, n % microbatches
    sizes = tf.stack([base + tf.cast(m < extra, n.dtype) for m in range(microbatches)])
    return [tf.split(v, sizes, num=microbatches, axis=0) for v in flat_x]


class _Pipeline:
    """One pipelined step: its stages, and what each ``(stage, micro-batch)`` made.

    The forward pass, the loss and the backward pass all read the same
    per-``(s, m)`` tapes and tensors, so they live here rather than being
    passed between functions:

    * ``tapes[s, m]`` -- the tape of stage ``s``'s forward pass on micro-batch ``m``;
    * ``ins[s, m]`` -- ``(key, tensor)`` of the inputs it watched (those that
      need a gradient sent back to an earlier stage);
    * ``outs[s, m]`` -- the tensors it sent on, in ``stages[s].outputs`` order;
    * ``added[s, m]`` -- the losses its layers added (``add_loss`` or an
      activity regularizer), computed in its tape;
    * ``values[m]`` -- every tensor of micro-batch ``m`` made so far, by key;
    * ``upstream[m]`` -- the gradients flowing back to the tensors of
      micro-batch ``m``, by key; ``grads`` -- the variables' gradients so far.
    """

    def __init__(self, model, plan, microbatches):
        self.model = model
        self.microbatches = microbatches
        self.stages, self.model_inputs, self.model_outputs = _stages(model, plan)
        self.variables = model.trainable_variables
        self.not_watched = set(self.model_inputs)  # the model's inputs need no gradient
        self.tapes, self.ins, self.outs, self.values, self.added = {}, {}, {}, [], {}
        self.upstream, self.added_grads, self.grads = None, None, None

    def forward(self, split_x):
        """Runs micro-batch m through stage s, for every m and s in that order.

        Each stage's ops are made in its own tape, on its device; the
        dataflow, not this loop's order, lets stage ``s+1`` work on one
        micro-batch while stage ``s`` works on the next.
        """
        for m in range(self.microbatches):
            self.values.append(dict(zip(self.model_inputs, (v[m] for v in split_x))))
            for s in range(len(self.stages)):
                self._forward_stage(s, m)

    def _forward_stage(self, s, m):
        """Stage ``s``'s layers on micro-batch ``m``, recorded in a tape of their own.

        Its inputs are first copied onto the stage's device, Keras masks
        included: the copy is the one transfer across the cut, and the tape
        watches the copies, whose gradients the backward pass hands back to
        the stages that made them.
        """
        stage, values = self.stages[s], self.values[m]
        with tf.device(stage.device):
            local = {k: _carry(values[k]) for k in stage.inputs}
            self.added[s, m] = []
            with tf.GradientTape() as tape:
                watched = [
                    k
                    for k in stage.inputs
                    if k not in self.not_watched and local[k].dtype.is_floating
                ]
                tape.watch([local[k] for k in watched])
                for call in stage.calls:
                    call(local, True)
                    self.added[s, m] += _integration.added_losses(call.layer)
            self.tapes[s, m] = tape
            self.ins[s, m] = [(k, local[k]) for k in watched]
            self.outs[s, m] = [local[k] for k in stage.outputs]
            values.update(zip(stage.outputs, self.outs[s, m]))

    def loss(self, x, y, sample_weight):
        """``(loss, y_pred)``: Keras' own loss on the concatenated predictions.

        Computing the loss on the whole batch makes any loss, weighted or
        not, decomposable or not, exactly the unpipelined one. It runs on the
        last stage's device once every micro-batch has come out -- the GPipe
        schedule: all forwards, then all backwards. Its gradients with respect
        to each micro-batch's predictions and each added loss seed the
        backward pass; its gradients with respect to the variables directly
        (e.g. weight regularisation terms) start ``grads``.
        """
        _check_added_losses(self.added, self.stages, self.microbatches)
        model, outputs, every_m = self.model, self.model_outputs, range(self.microbatches)
        preds = [[self.values[m][k] for k in outputs] for m in every_m]
        flat_preds = [p for per_m in preds for p in per_m]
        flat_added = [t for s in range(len(self.stages)) for t in self.added[s, 0]]
        with tf.device(self.stages[-1].device):
            with tf.GradientTape() as tape:
                # Keras's loss adds model.losses: the layers' added losses are
                # those very tensors, computed in the stages' tapes.
                tape.watch(flat_preds + flat_added)
                y_pred = _pack_outputs(
                    model, [_concat([preds[m][i] for m in every_m]) for i in range(len(outputs))]
                )
                loss = _integration.compute_loss(model, x, y, y_pred, sample_weight)
                scaled = loss if model.optimizer is None else model.optimizer.scale_loss(loss)
            g = tape.gradient(
                scaled,
                [*flat_preds, *flat_added, *self.variables],
                unconnected_gradients=tf.UnconnectedGradients.NONE,
            )
        self._seed_backward(g, len(flat_preds), len(flat_added))
        return loss, y_pred

    def _seed_backward(self, g, num_preds, num_added):
        """Splits the loss's gradients ``g`` into ``upstream``, ``added_grads``, ``grads``."""
        k = len(self.model_outputs)
        self.upstream = [
            dict(zip(self.model_outputs, g[m * k : (m + 1) * k])) for m in range(self.microbatches)
        ]
        added_grads = iter(g[num_preds : num_preds + num_added])
        self.added_grads = {
            s: [next(added_grads) for _ in self.added[s, 0]] for s in range(len(self.stages))
        }
        self.grads = list(g[num_preds + num_added :])

    def backward(self):
        """The variables' gradients, summed over every stage and micro-batch.

        Stage by stage in reverse, so that a stage's outputs have all their
        gradients (a tensor read by several later stages gets the sum of
        theirs) before its own tape is differentiated.
        """
        for m in range(self.microbatches):
            for s in range(len(self.stages) - 1, -1, -1):
                if self.stages[s].outputs or self.added[s, m]:
                    self._backward_stage(s, m)
        return self.grads

    def _backward_stage(self, s, m):
        """Differentiates stage ``s``'s tape for micro-batch ``m``, on its device.

        Under stage_gradients, the backward ops of a column-split layer's
        shards go to the shards' devices, the rest to the stage's. An output
        or added loss that the loss does not depend on gets a zero gradient.
        """
        stage, upstream = self.stages[s], self.upstream[m]
        with tf.device(stage.device), _placement.stage_gradients():
            output_gradients = [
                upstream.get(key) if upstream.get(key) is not None else tf.zeros_like(out)
                for key, out in zip(stage.outputs, self.outs[s, m])
            ]
            # Added losses: only with one micro-batch (_check_added_losses).
            output_gradients += [
                tf.zeros_like(t) if gt is None else gt
                for t, gt in zip(self.added[s, m], self.added_grads[s])
            ]
            head = self.ins[s, m]
            g = self.tapes[s, m].gradient(
                self.outs[s, m] + self.added[s, m],
                [h for _, h in head] + self.variables,
                output_gradients=output_gradients,
                unconnected_gradients=tf.UnconnectedGradients.NONE,
            )
            for (key, _), gk in zip(head, g[: len(head)]):
                upstream[key] = _add(upstream.get(key), gk)
            for i, gv in enumerate(g[len(head) :]):
                self.grads[i] = _add(self.grads[i], gv)


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
