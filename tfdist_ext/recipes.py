"""The training recipe of Goyal et al. (2017) applied to a Keras model.

Example:
  >>> import keras
  >>> from tfdist_ext.recipes import apply_goyal_recipe
  >>> x = keras.Input((8,))
  >>> branch = keras.layers.Dense(8, name="block1_dense")(x)
  >>> branch = keras.layers.BatchNormalization(name="block1_bn2")(branch)
  >>> model = keras.Model(x, keras.layers.Add()([x, branch]))
  >>> report = apply_goyal_recipe(model, weight_decay=1e-4)
  >>> report["zero_gamma"], report["weight_decay"]
  (['block1_bn2'], ['block1_dense'])
"""

import numbers
from collections.abc import Sequence

import keras

from tfdist_ext import _integration

_NORMALIZATION = (
    keras.layers.BatchNormalization,
    keras.layers.LayerNormalization,
    keras.layers.GroupNormalization,
)


def apply_goyal_recipe(
    model: keras.Model,
    *,
    weight_decay: float = 1e-4,
    zero_gamma: bool = True,
    zero_gamma_layers: Sequence[str] | None = None,
) -> dict[str, list[str]]:
    """Applies the paper's implementation details (Sec. 3 and 5.1) to ``model``.

    * **Zero-gamma**: the last batch-norm layer of each residual branch gets
      ``gamma = 0`` (weights and ``gamma_initializer``), so every residual
      block starts as the identity. A residual block is found from each
      ``keras.layers.Add`` of a functional model: of its inputs, the branch
      with the most layers back to their common ancestor is the residual
      branch (a projection shortcut is shorter), and its batch norm is the
      one feeding the ``Add`` (possibly through weightless layers). Pass
      ``zero_gamma_layers`` (layer names) to choose them yourself.
    * **Weight decay as a loss term**: ``weight_decay / 2 * ||w||^2`` (gradient
      ``weight_decay * w``, the paper's ``lambda``) through an L2
      ``kernel_regularizer`` on every layer with a ``kernel`` (Dense, Conv...),
      and none on biases or normalisation parameters (the paper's choice: no
      decay on gamma and beta).

    Call it on a built model, before the first ``fit`` (Keras collects
    regularisation losses when it traces the training step). The changes are
    part of the model's config and weights, so they survive ``model.save``.

    Args:
      model: a built ``keras.Model``.
      weight_decay: lambda (>= 0); 0 leaves the kernels alone.
      zero_gamma: apply zero-gamma initialisation.
      zero_gamma_layers: optional explicit layer names for zero-gamma.

    Returns:
      ``{"zero_gamma": [layer names], "weight_decay": [layer names]}``.

    Raises:
      ValueError: ``model`` is not a built Keras model, ``weight_decay`` is
        negative, or a named layer is missing or not a normalisation layer
        with a gamma.

    Example:
      >>> report = apply_goyal_recipe(resnet, weight_decay=1e-4)  # doctest: +SKIP
    """
    _check_recipe_args(model, weight_decay)
    report = {"zero_gamma": [], "weight_decay": []}
    if zero_gamma:
        layers = (
            _named_layers(model, zero_gamma_layers)
            if zero_gamma_layers is not None
            else residual_branch_norms(model)
        )
        for layer in layers:
            _zero_gamma(layer)
            report["zero_gamma"].append(layer.name)
    if weight_decay > 0:
        report["weight_decay"] = _decay_kernels(model, weight_decay)
    return report


def _check_recipe_args(model, weight_decay):
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"apply_goyal_recipe: model must be a keras.Model, got {type(model).__name__}"
        )
    if not model.built:
        raise ValueError("apply_goyal_recipe: build the model first (call it or give it an Input)")
    if (
        isinstance(weight_decay, bool)
        or not isinstance(weight_decay, numbers.Real)
        or weight_decay < 0
    ):
        raise ValueError(
            f"apply_goyal_recipe: weight_decay must be a number >= 0, got {weight_decay!r}"
        )


def _decay_kernels(model, weight_decay):
    """An L2 regulariser of ``weight_decay / 2`` on every kernel outside the
    normalisation layers; the names of the layers it went to."""
    names = []
    for layer in _all_layers(model):
        kernel = getattr(layer, "kernel", None)
        if kernel is None or isinstance(layer, _NORMALIZATION):
            continue
        regularizer = keras.regularizers.L2(weight_decay / 2.0)
        layer.kernel_regularizer = regularizer
        kernel.regularizer = regularizer
        names.append(layer.name)
    return names


def residual_branch_norms(model: keras.Model) -> list[keras.layers.Layer]:
    """The batch-norm layers that end a residual branch, one per ``Add``.

    Example:
      >>> [bn.name for bn in residual_branch_norms(resnet)]  # doctest: +SKIP
      ['block1_bn2', 'block2_bn2']
    """
    found = []
    for layer in _all_layers(model):
        if not isinstance(layer, keras.layers.Add):
            continue
        for node in _integration.inbound_nodes(layer):
            inputs = [_producer(t) for t in node.input_tensors]
            branch = _residual_input(inputs)
            norm = _norm_feeding(branch) if branch is not None else None
            if norm is not None and norm not in found:
                found.append(norm)
    return found


def _all_layers(model):
    out = []
    for layer in model.layers:
        out.append(layer)
        if isinstance(layer, keras.Model):
            out.extend(_all_layers(layer))
    return out


def _named_layers(model, names):
    by_name = {layer.name: layer for layer in _all_layers(model)}
    layers = []
    for name in names:
        layer = by_name.get(name)
        if layer is None:
            raise ValueError(f"apply_goyal_recipe: no layer named {name!r} in the model")
        if getattr(layer, "gamma", None) is None:
            raise ValueError(
                f"apply_goyal_recipe: layer {name!r} is not a normalisation layer with a gamma"
            )
        layers.append(layer)
    return layers


def _zero_gamma(layer):
    layer.gamma.assign(keras.ops.zeros_like(layer.gamma))
    layer.gamma_initializer = keras.initializers.Zeros()


def _producer(tensor):
    return _integration.producer(tensor)


def _parents(layer):
    parents = []
    for node in _integration.inbound_nodes(layer)[:1]:
        parents.extend(p for p in (_producer(t) for t in node.input_tensors) if p is not None)
    return parents


def _ancestors(layer):
    seen, stack = {}, [(layer, 0)]
    while stack:
        current, depth = stack.pop()
        if id(current) in seen and seen[id(current)][1] <= depth:
            continue
        seen[id(current)] = (current, depth)
        stack.extend((p, depth + 1) for p in _parents(current))
    return {key: depth for key, (_, depth) in seen.items()}


def _residual_input(inputs):
    """Of an ``Add``'s producers, the one with the longest path to a common ancestor."""
    inputs = [i for i in inputs if i is not None]
    if len(inputs) < 2:
        return None
    ancestry = [_ancestors(i) for i in inputs]
    common = set(ancestry[0]).intersection(*ancestry[1:])
    if not common:
        return None
    lengths = [min(a[c] for c in common) for a in ancestry]
    longest = max(lengths)
    if lengths.count(longest) > 1:
        return None  # ambiguous: no clear residual branch
    return inputs[lengths.index(longest)]


def _norm_feeding(layer):
    """The normalisation layer reached from ``layer`` through weightless layers."""
    while layer is not None:
        if isinstance(layer, _NORMALIZATION) and getattr(layer, "gamma", None) is not None:
            return layer
        parents = _parents(layer)
        if layer.weights or len(parents) != 1:
            return None
        layer = parents[0]
    return None


__all__ = ["apply_goyal_recipe", "residual_branch_norms"]
