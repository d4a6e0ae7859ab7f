"""Partition plans: which contiguous block of layers lives on which device (internal).

A plan is made over the *top-level* layers of a Keras model in call order
(nested models count as one unit): a ``Sequential`` model's layers, a
topological order of a functional model's graph, or the sub-layers of a
subclassed model in the order it tracks them. Costs are estimated statically from the
built model, without running it:

* parameter bytes -- exact (``sum(v.size * dtype bytes)`` of the layer's
  variables); this is what must fit into a device's memory, so ``"balanced"``
  minimises the largest per-device parameter bytes by default;
* forward FLOPs per example -- an analytical estimate (``2*in*out`` for
  ``Dense``, ``2*kh*kw*cin*cout*out_pixels`` for convolutions, one FLOP per
  output element for parameter-free layers); ``balance_by="flops"`` balances
  these instead, which is what matters for pipelined step time;
* activation bytes per example that cross a stage boundary placed after each
  layer: its output in a chain; in a functional model every tensor made at or
  before the layer and read after it (branches, skip connections; layers are
  in a topological order of the graph, where stages are cut).

A static estimate is used rather than a profiling pass because it is
deterministic (the same plan on every run, for save/load and for tests) and
needs no data; parameter bytes are exact anyway.
"""

import dataclasses
import math
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Literal

import keras
import numpy as np

from tfdist_ext import _integration
from tfdist_ext.model_parallel._layers import column_sizes

# A built Keras model, or its layers in call order.
ModelOrLayers = keras.Model | Sequence[keras.layers.Layer]


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """Static cost of one top-level layer (bytes and FLOPs are per example).

    Example:
      >>> [(c.name, c.param_bytes, c.flops) for c in layer_costs(model)]  # doctest: +SKIP
      [('dense', 33024, 16384), ('dense_1', 2580, 1280)]
    """

    name: str
    param_bytes: int
    flops: int
    activation_bytes: int  # crossing a cut after this layer (all branches)
    shard_bytes: tuple = ()  # per-shard bytes for a column-split layer


@dataclasses.dataclass(frozen=True)
class Stage:
    """One device's share of a plan: its layers and their costs.

    Example:
      >>> stage = plan.stages[0]                        # doctest: +SKIP
      >>> stage.device, stage.layers, stage.param_bytes  # doctest: +SKIP
      ('/device:CPU:0', ('dense',), 33024)
    """

    device: str
    layers: tuple
    param_bytes: int
    flops: int
    boundary_bytes: int  # activation bytes per example sent to the next stage


@dataclasses.dataclass(frozen=True)
class Plan:
    """A partition of a model's layers into contiguous stages, one per device.

    ``stages`` lists, per device, its layers, parameter bytes, estimated
    forward FLOPs per example and the activation bytes per example it sends to
    the next stage. Column-split layers (:class:`ColumnParallelDense`) appear in
    one stage (where their input and concatenated output live) and add their
    shards' bytes to ``device_param_bytes`` of the devices holding the shards.
    ``splits`` names the ``Dense`` layers the planner decided to split
    column-wise because their parameters exceed ``device_budget_bytes``
    (``{layer name: number of shards}``); :func:`apply_plan` replaces each by a
    :class:`ColumnParallelDense` with the same weights. ``partition`` says how
    the stages were chosen: ``"balanced"``, ``"explicit"`` (a
    ``{layer: device}`` map) or ``"filled"`` (a :class:`ModelParallelStrategy`
    with a ``device_budget_bytes`` kept the layers where it created them,
    filling the devices in order).

    Example:
      >>> plan = plan_partition(model, ["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
      >>> plan.device_of("dense_1")                                        # doctest: +SKIP
      '/device:CPU:1'
      >>> print(plan)                                                      # doctest: +SKIP
    """

    stages: tuple
    devices: tuple
    partition: str
    balance_by: str
    shard_devices: dict = dataclasses.field(default_factory=dict)
    shard_bytes: dict = dataclasses.field(default_factory=dict)
    splits: dict = dataclasses.field(default_factory=dict)
    device_budget_bytes: int = None

    def device_of(self, layer_name):
        """The device of the stage holding ``layer_name`` (a top-level layer)."""
        for stage in self.stages:
            if layer_name in stage.layers:
                return stage.device
        raise KeyError(f"layer {layer_name!r} is not in this plan")

    @property
    def layer_devices(self):
        """``{layer name: device}`` for every planned layer."""
        return {name: s.device for s in self.stages for name in s.layers}

    @property
    def device_param_bytes(self):
        """``{device: parameter bytes}`` including the shards of split layers."""
        out = {d: 0 for d in self.devices}
        for stage in self.stages:
            out[stage.device] += stage.param_bytes
        for name, devices in self.shard_devices.items():
            for device, nbytes in zip(devices, self.shard_bytes[name]):
                out[device] += nbytes
        return out

    @property
    def total_param_bytes(self):
        return sum(self.device_param_bytes.values())

    @property
    def max_fraction(self):
        """Largest per-device parameter bytes / total parameter bytes."""
        total = self.total_param_bytes
        return max(self.device_param_bytes.values()) / total if total else 0.0

    def to_dict(self):
        """A JSON-friendly description of the plan."""
        per_device = self.device_param_bytes
        return {
            "partition": self.partition,
            "balance_by": self.balance_by,
            "stages": [
                {
                    "device": s.device,
                    "layers": list(s.layers),
                    "param_bytes": per_device[s.device],
                    "flops": s.flops,
                    "boundary_bytes": s.boundary_bytes,
                }
                for s in self.stages
            ],
            "shards": {k: list(v) for k, v in self.shard_devices.items()},
            "shard_bytes": {k: list(v) for k, v in self.shard_bytes.items()},
            "splits": dict(self.splits),
            "device_budget_bytes": self.device_budget_bytes,
        }

    def __str__(self):
        per_device = self.device_param_bytes
        how = {
            "balanced": f"balanced by {self.balance_by}",
            "filled": "devices filled in order as the layers were created",
        }.get(self.partition, "explicit map")
        if self.device_budget_bytes is not None:
            how += f", budget {self.device_budget_bytes:,} B/device"
        lines = [f"Plan ({how}):"]
        for s in self.stages:
            lines.append(
                f"  {s.device}: {len(s.layers)} layer(s) {list(s.layers)}, "
                f"{per_device[s.device]:,} parameter bytes, "
                f"{s.flops:,} FLOPs/example, sends {s.boundary_bytes:,} B/example"
            )
        for name, devices in self.shard_devices.items():
            sizes = ", ".join(f"{b:,}" for b in self.shard_bytes[name])
            how = (
                f"Dense of {sum(self.shard_bytes[name]):,} B split automatically into "
                f"{self.splits[name]} column shards"
                if name in self.splits
                else "column shards"
            )
            lines.append(f"  {name}: {how} on {list(devices)} ({sizes} B)")
        return "\n".join(lines)


def _dtype_bytes(dtype):
    return np.dtype(str(dtype)).itemsize


def _shape_elems(shape):
    dims = [d for d in tuple(shape)[1:]]
    if any(d is None for d in dims):
        return 0
    return int(math.prod(dims)) if dims else 1


def _output_shape(layer):
    try:
        return tuple(layer.output.shape)
    except (AttributeError, ValueError):
        return None


def _input_shape(layer):
    try:
        return tuple(layer.input.shape)
    except (AttributeError, ValueError):
        return None


def _flops(layer, in_shape, out_shape):

    out_elems = _shape_elems(out_shape) if out_shape else 0
    if isinstance(layer, keras.layers.Dense) or type(layer).__name__ == "ColumnParallelDense":
        in_dim = in_shape[-1] if in_shape else 0
        return 2 * int(in_dim or 0) * out_elems
    if isinstance(layer, keras.layers.Conv1D | keras.layers.Conv2D | keras.layers.Conv3D):
        kernel = layer.kernel.shape  # (*k, cin/groups, filters)
        per_out = 2 * int(math.prod(kernel[:-1]))
        return per_out * out_elems
    if isinstance(layer, keras.Model):
        return sum(_flops(sub, _input_shape(sub), _output_shape(sub)) for sub in layer.layers)
    if layer.weights:
        return 2 * sum(int(np.prod(v.shape)) for v in layer.weights) + out_elems
    return out_elems


def layer_costs(model_or_layers: ModelOrLayers) -> list[LayerCost]:
    """Static per-layer costs (:class:`LayerCost`) of a built model, in call order.

    Example:
      >>> costs = layer_costs(model)  # doctest: +SKIP
      >>> [c.param_bytes for c in costs]  # doctest: +SKIP
    """
    layers = top_level_layers(model_or_layers)
    crossing = _crossing_bytes(model_or_layers, layers)
    costs = []
    for i, layer in enumerate(layers):
        shard_bytes = ()
        if hasattr(layer, "shard_variables"):
            shard_bytes = tuple(
                sum(int(np.prod(v.shape)) * _dtype_bytes(v.dtype) for v in shard)
                for shard in layer.shard_variables()
            )
        total = sum(int(np.prod(v.shape)) * _dtype_bytes(v.dtype) for v in layer.weights)
        out_shape = _output_shape(layer)
        act = _shape_elems(out_shape) * _dtype_bytes(layer.compute_dtype) if out_shape else 0
        costs.append(
            LayerCost(
                name=layer.name,
                param_bytes=total - sum(shard_bytes),
                flops=int(_flops(layer, _input_shape(layer), out_shape)),
                activation_bytes=int(crossing[i] if crossing else act),
                shard_bytes=shard_bytes,
            )
        )
    return costs


def _tensor_bytes(keras_tensor):
    return _shape_elems(keras_tensor.shape) * _dtype_bytes(keras_tensor.dtype)


def _crossing_bytes(model, layers):
    """For a functional model: per example, the bytes of all tensors that cross a
    cut placed after each layer (in the topological order of ``layers``) --
    branches and skip connections included; ``None`` for other models."""
    if not _integration.is_functional(model):
        return None
    position = {id(layer): i for i, layer in enumerate(layers)}
    made, last_use, size = {}, {}, {}
    for t in model.inputs:
        made[id(t)], size[id(t)] = -1, _tensor_bytes(t)
    for op, node in _integration.graph_nodes(model):
        inputs = [made.get(id(t), -1) for t in node.input_tensors]
        # A call runs at its layer's position or where its last input is made,
        # whichever is later (as the pipeline runs it): an operation that is
        # not a layer, or a shared layer's call after a later layer's.
        p = max([position.get(id(op), 0), *inputs])
        for t in node.input_tensors:
            last_use[id(t)] = max(last_use.get(id(t), -1), p)
        for t in node.outputs:
            made[id(t)], size[id(t)] = p, _tensor_bytes(t)
    for t in model.outputs:
        last_use[id(t)] = len(layers)
    crossing = [0] * len(layers)
    for key, p in made.items():
        for j in range(max(p, 0), min(last_use.get(key, p), len(layers))):
            crossing[j] += size[key]
    return crossing


def top_level_layers(model_or_layers):
    """The top-level layers of a model in call order (input layers dropped)."""
    if isinstance(model_or_layers, keras.Model):
        if not _built(model_or_layers):
            raise ValueError(
                f"model {model_or_layers.name!r} is not built: give it an Input "
                "(or call it once) before planning its partition"
            )
        layers = model_or_layers.layers
    else:
        layers = list(model_or_layers)
    return [l for l in layers if not isinstance(l, keras.layers.InputLayer)]


def _built(model):
    """Whether ``model``'s variables all exist: it is built, or it is being
    built by its first call and all its layers are (a subclassed model)."""
    return model.built or bool(model.layers) and all(l.built for l in model.layers)


def _check_devices(devices):
    if isinstance(devices, str) or not devices:
        raise ValueError(f"devices must be a non-empty list of device names, got {devices!r}")
    devices = [str(d) for d in devices]
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices must be distinct, got {devices}")
    return devices


def _balanced_bounds(costs, k, weight, tolerance, offsets=None):
    """Contiguous split of ``costs`` into ``k`` non-empty stages.

    First finds the smallest achievable bottleneck (largest stage weight, plus
    ``offsets[s]`` already on stage ``s``'s device, e.g. column shards) by
    dynamic programming; then, among splits whose stages all stay within
    ``bottleneck * (1 + tolerance)``, picks the one with the fewest activation
    bytes crossing stage boundaries. Returns the k-1 cut positions.
    """
    n = len(costs)
    w = [weight(c) for c in costs]
    offsets = offsets or [0] * k
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)

    def stage(s, i, j):  # weight of stage s (1-based) holding layers [i, j)
        return prefix[j] - prefix[i] + offsets[s - 1]

    inf = float("inf")
    # best[s][j]: minimal bottleneck splitting the first j layers into s stages
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for s in range(1, k + 1):
        for j in range(s, n + 1):
            best[s][j] = min(max(best[s - 1][i], stage(s, i, j)) for i in range(s - 1, j))
    limit = best[k][n] * (1 + tolerance) + 1e-9
    # comm[s][j]: minimal boundary bytes with every stage <= limit
    comm = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[-1] * (n + 1) for _ in range(k + 1)]
    comm[0][0] = 0
    for s in range(1, k + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                if comm[s - 1][i] == inf or stage(s, i, j) > limit:
                    continue
                cost = comm[s - 1][i] + (costs[j - 1].activation_bytes if j < n else 0)
                if cost < comm[s][j]:
                    comm[s][j], back[s][j] = cost, i
    cuts, j = [], n
    for s in range(k, 0, -1):
        i = back[s][j]
        cuts.append(i)
        j = i
    return sorted(cuts)[1:]


def plan_partition(
    model_or_layers: ModelOrLayers,
    devices: Sequence[str],
    partition: str | Mapping[str, str] = "balanced",
    *,
    balance_by: Literal["params", "flops"] = "params",
    device_budget_bytes: int | None = None,
    split_large_layers: bool = True,
    tolerance: float = 0.0,
) -> Plan:
    """Plans contiguous stages of a built Keras model over ``devices``.

    This is the placement engine of :class:`ModelParallelStrategy`, usable on its
    own (for example by a data-parallel strategy that places one replica across
    the devices of one worker): make a plan, then :func:`apply_plan` it.

    Args:
      model_or_layers: a built ``keras.Model`` (its top-level layers in call
        order are the units) or a list of built layers.
      devices: device names, one stage each, in pipeline order.
      partition: ``"balanced"`` or ``{layer name: device}``. In an explicit map,
        parameter-free layers may be omitted (they follow the previous layer);
        every layer with parameters must be named.
      balance_by: ``"params"`` (the default: the largest per-device parameter
        bytes, column shards included, is minimised, as memory is why one
        partitions) or ``"flops"`` (estimated forward FLOPs, for pipelined speed).
      device_budget_bytes: optional parameter-byte capacity of each device;
        a plan exceeding it raises ``ValueError``.
      split_large_layers: split a ``Dense`` layer larger than
        ``device_budget_bytes`` column-wise instead of raising; how and when:
        "Planning without the strategy" in the model-parallelism guide.
      tolerance: stages may exceed the optimal bottleneck by this fraction if
        that reduces the activation bytes crossing stage boundaries.

    Returns:
      A :class:`Plan`.

    Raises:
      ValueError: bad devices or partition; more stages than layers; a layer
        over ``device_budget_bytes`` not split, or whose column shards do not
        fit one per device; a plan over budget.

    Example:
      >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
      ...                           keras.layers.Dense(2)])          # doctest: +SKIP
      >>> plan = plan_partition(model, ["/device:CPU:0", "/device:CPU:1"])  # doctest: +SKIP
      >>> plan.layer_devices   # doctest: +SKIP
      {'dense': '/device:CPU:0', 'dense_1': '/device:CPU:1'}
    """
    devices = _check_arguments(devices, balance_by, tolerance, device_budget_bytes)
    planner = _Planner(
        model_or_layers, devices, partition, balance_by, tolerance, device_budget_bytes
    )
    return planner.plan(split_large_layers)


def _check_arguments(devices, balance_by, tolerance, device_budget_bytes):
    """Refuses bad arguments before the model is read; returns the device names as strings."""
    devices = _check_devices(devices)
    if balance_by not in ("params", "flops"):
        raise ValueError(f"balance_by must be 'params' or 'flops', got {balance_by!r}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    if device_budget_bytes is not None and device_budget_bytes <= 0:
        raise ValueError(f"device_budget_bytes must be positive, got {device_budget_bytes!r}")
    return devices


def _split_problem(model_or_layers, layer):
    """Why ``layer`` cannot be split column-wise automatically (``None`` if it can)."""
    if type(layer) is not keras.layers.Dense:
        return (
            f"it is a {type(layer).__name__}; only keras.layers.Dense layers are "
            "split automatically"
        )
    if layer.lora_enabled or layer.quantization_mode:
        return "it has LoRA enabled or is quantized"
    for attr in ("kernel_regularizer", "bias_regularizer", "kernel_constraint", "bias_constraint"):
        if getattr(layer, attr, None) is not None:
            return f"it has a {attr.replace('_', ' ')}"
    if isinstance(model_or_layers, keras.Model) and not isinstance(
        model_or_layers, keras.Sequential
    ):
        return (
            f"model {model_or_layers.name!r} is not a Sequential model (automatic "
            "splitting replaces the layer inside a Sequential model); build this "
            "layer as a ColumnParallelDense(num_shards=...) instead"
        )
    return None


def _max_shards(layer, k):
    return min(k, layer.units)


def _dense_shard_bytes(layer, num_shards):
    """Parameter bytes of each column shard of ``Dense`` ``layer`` split ``num_shards`` ways."""
    in_dim = int(layer.kernel.shape[0])
    dtype = _dtype_bytes(layer.kernel.dtype)
    return tuple(
        (in_dim * size + (size if layer.use_bias else 0)) * dtype
        for size in column_sizes(layer.units, num_shards)
    )


def _automatic_splits(model_or_layers, layers, costs, k, budget, split_large_layers):
    """``{layer index: fewest column shards}`` for the layers over ``budget``."""
    splits = {}
    for i, (layer, c) in enumerate(zip(layers, costs)):
        if c.shard_bytes or c.param_bytes <= budget:
            continue
        head = (
            f"layer {c.name!r} needs {c.param_bytes:,} parameter bytes on one device, "
            f"more than the device budget of {budget:,} bytes"
        )
        if not split_large_layers:
            raise ValueError(
                f"{head}, and split_large_layers is off; turn it on to split Dense "
                "layers column-wise automatically, split the layer with "
                "tfdist_ext.model_parallel.ColumnParallelDense(num_shards=...), or "
                "raise device_budget_bytes"
            )
        problem = _split_problem(model_or_layers, layer)
        if problem is not None:
            raise ValueError(f"{head}, and it cannot be split automatically: {problem}")
        most = _max_shards(layer, k)
        for n in range(2, most + 1):
            if max(_dense_shard_bytes(layer, n)) <= budget:
                splits[i] = n
                break
        else:
            shard = max(_dense_shard_bytes(layer, most))
            raise ValueError(
                f"{head}; split column-wise over all {most} devices its largest shard "
                f"would still need {shard:,} bytes; add devices or raise "
                "device_budget_bytes"
            )
    return splits


def _assign_shards(sizes, devices, load):
    """Each shard to the device with the fewest shard bytes so far (distinct if possible)."""
    chosen = []
    for nbytes in sizes:
        free = [d for d in devices if d not in chosen] or devices
        device = min(free, key=lambda d: (load[d], devices.index(d)))
        chosen.append(device)
        load[device] += nbytes
    return tuple(chosen)


class _Planner:
    """One :func:`plan_partition` call: the model's layers, their costs, the options.

    Within a budget, planning may make several whole plans (more column
    shards each time) over the same layers, costs, devices and options; they
    live here rather than being passed to every step.
    """

    def __init__(self, model_or_layers, devices, partition, balance_by, tolerance, budget):
        self.model_or_layers = model_or_layers
        self.costs = layer_costs(model_or_layers)
        self.layers = top_level_layers(model_or_layers)
        if not self.costs:
            raise ValueError("the model has no layers to partition")
        if partition != "balanced" and not isinstance(partition, dict):
            raise ValueError(
                f"partition must be 'balanced' or a dict {{layer name: device}}, got {partition!r}"
            )
        self.devices, self.partition = devices, partition
        self.balance_by, self.tolerance, self.budget = balance_by, tolerance, budget

    def plan(self, split_large_layers):
        """The plan, once the checks that need no plan (layers over budget, too few layers) pass."""
        costs, devices, budget = self.costs, self.devices, self.budget
        splits = {}  # index of an automatically split Dense -> fewest shards that fit
        if budget is not None:
            splits = _automatic_splits(
                self.model_or_layers, self.layers, costs, len(devices), budget, split_large_layers
            )
            self._check_shards_fit()
        if self.partition == "balanced" and len(devices) > len(costs):
            raise ValueError(
                f"cannot make {len(devices)} stages from {len(costs)} layer(s) "
                f"({[c.name for c in costs]}): use at most {len(costs)} devices"
            )
        return self._plan_within_budget(splits)

    def _check_shards_fit(self):
        """Refuses a column-split layer with a shard over budget: no plan can fit it."""
        budget = self.budget
        for c in self.costs:
            if c.shard_bytes and max(c.shard_bytes) > budget:
                raise ValueError(
                    f"layer {c.name!r} has a column shard of {max(c.shard_bytes):,} "
                    f"parameter bytes, more than the device budget of {budget:,} bytes; "
                    "give it more shards (ColumnParallelDense(num_shards=...)) or raise "
                    "device_budget_bytes"
                )

    def _plan_within_budget(self, splits):
        """The plan with the fewest shards per split layer that fits ``budget``.

        ``splits`` holds the fewest shards that fit each layer alone; more
        (one more for every split layer at a time, at most one per device) only
        if the whole plan does not fit otherwise.
        """
        budget, k = self.budget, len(self.devices)
        extra = 0
        while True:
            counts = {i: min(n + extra, _max_shards(self.layers[i], k)) for i, n in splits.items()}
            plan = self._make_plan(counts)
            over = {
                d: b
                for d, b in plan.device_param_bytes.items()
                if budget is not None and b > budget
            }
            if not over or all(counts[i] == _max_shards(self.layers[i], k) for i in counts):
                break
            extra += 1
        if over:
            device, nbytes = max(over.items(), key=lambda item: item[1])
            split = "".join(
                f"; {self.costs[i].name!r} is split into {n} column shards"
                for i, n in counts.items()
            )
            raise ValueError(
                f"the {plan.partition} plan puts {nbytes:,} parameter bytes on {device}, "
                f"more than the device budget of {budget:,} bytes{split}; add devices, "
                "raise device_budget_bytes or split large layers with ColumnParallelDense"
            )
        return plan

    def _make_plan(self, splits):
        """The plan with the ``Dense`` layers in ``splits`` (``{index: shards}``) split."""
        costs, shard_devices, shard_bytes, load = self._place_shards(splits)
        groups, name = self._stage_groups(costs, load)
        stages = tuple(
            Stage(
                device=d,
                layers=tuple(c.name for c in group),
                param_bytes=sum(c.param_bytes for c in group),
                flops=sum(c.flops for c in group),
                boundary_bytes=group[-1].activation_bytes if group and i < len(groups) - 1 else 0,
            )
            for i, (d, group) in enumerate(groups)
        )
        return Plan(
            stages=stages,
            devices=tuple(self.devices),
            partition=name,
            balance_by=self.balance_by,
            shard_devices=shard_devices,
            shard_bytes=shard_bytes,
            splits={costs[i].name: n for i, n in splits.items()},
            device_budget_bytes=self.budget,
        )

    def _place_shards(self, splits):
        """The column shards' devices, before the stages are cut.

        Returns the costs (a split layer's parameters moved into its shards),
        ``{layer: shard devices}``, ``{layer: shard bytes}`` and the shard
        bytes per device, which the balanced cut counts as already there.
        """
        devices, costs = self.devices, list(self.costs)
        shard_devices, shard_bytes = {}, {}
        load = {d: 0 for d in devices}  # column-shard bytes per device
        for i, layer in enumerate(self.layers):
            if i in splits:
                costs[i] = dataclasses.replace(
                    costs[i], param_bytes=0, shard_bytes=_dense_shard_bytes(layer, splits[i])
                )
            c = costs[i]
            if not c.shard_bytes:
                continue
            explicit = None if i in splits else getattr(layer, "devices", None)
            if explicit:
                explicit = _explicit_shard_devices(c, explicit, devices, load)
            shard_devices[c.name] = explicit or _assign_shards(c.shard_bytes, devices, load)
            shard_bytes[c.name] = c.shard_bytes
        return costs, shard_devices, shard_bytes, load

    def _stage_groups(self, costs, load):
        """``([(device, its costs)], partition name)``: the contiguous stages."""
        devices = self.devices
        if self.partition == "balanced":
            k = len(devices)
            if self.balance_by == "params":
                weight, offsets = (lambda c: c.param_bytes), [load[d] for d in devices]
            else:
                weight, offsets = (lambda c: c.flops), None
            cuts = [0, *_balanced_bounds(costs, k, weight, self.tolerance, offsets), len(costs)]
            return [(devices[s], costs[cuts[s] : cuts[s + 1]]) for s in range(k)], "balanced"
        return _explicit_groups(costs, self.layers, devices, self.partition), "explicit"


def _explicit_shard_devices(cost, layer_devices, devices, load):
    """A ColumnParallelDense's own shard devices, checked, their bytes added to ``load``.

    ``load`` is what the shards placed by the planner and the balanced cut
    see already on each device.
    """
    explicit = tuple(str(d) for d in layer_devices)
    outside = sorted(set(explicit) - set(devices))
    if outside:
        raise ValueError(
            f"layer {cost.name!r} puts column shards on {outside}, "
            f"which are not in devices={devices}"
        )
    for d, nbytes in zip(explicit, cost.shard_bytes):
        load[d] += nbytes
    return explicit


def _explicit_groups(costs, layers, devices, partition):
    names = [c.name for c in costs]
    unknown = sorted(set(partition) - set(names))
    if unknown:
        raise ValueError(
            f"partition names layers the model does not have: {unknown}; its layers are {names}"
        )
    bad = sorted({str(d) for d in partition.values()} - set(devices))
    if bad:
        raise ValueError(f"partition uses devices {bad} that are not in devices={devices}")
    missing = [c.name for c, l in zip(costs, layers) if l.weights and c.name not in partition]
    if missing:
        raise ValueError(f"partition does not place the layers with parameters {missing}")
    groups, current = [], None
    for c in costs:
        device = str(partition.get(c.name, current or devices[0]))
        if groups and groups[-1][0] == device:
            groups[-1][1].append(c)
        else:
            groups.append((device, [c]))
        current = device
    seen = [g[0] for g in groups]
    if len(set(seen)) != len(seen):
        raise ValueError(
            f"an explicit partition must give each device one contiguous block of "
            f"layers; got the device sequence {seen}"
        )
    return groups
