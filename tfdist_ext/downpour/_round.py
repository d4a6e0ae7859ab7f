"""The round a Downpour worker runs (internal).

A round is a multiple of ``lcm(n_fetch, n_push)`` local steps on one worker
(as many as the chief asks for: one dispatch, many steps), traced once as a
``tf.function``: fetch the parameters from the ``ps`` shards, run the local
steps on that copy (``keras.StatelessScope`` maps the model's variables to
the local tensors), fetch again every ``n_fetch`` steps, and push the summed
gradient every ``n_push`` steps through the compiled optimizer, whose update
ops run on the ``ps`` task that owns each variable; a push or a fetch moves
one tensor per ``ps`` task. The steps run in blocks of ``gcd(n_fetch,
n_push)``, an inner loop of the worker's own ops (a loop with ``ps`` ops
in it makes every ``ps`` task take part in each of its iterations). While a
block computes, the previous block's push is applied and the parameters for
the next fetch point are read after it (DistBelief's background push and
fetch; one push of staleness, measured). The parameters are read on the
``ps`` tasks in every block and cross only when a fetch is due, in a cond
of no stateful op: the next block's push, checked on the worker, crosses
while they do. The metrics accumulate on a local copy too, added to the
model's metric variables at the round's end. Round
boundaries fall exactly where both a fetch and a push are due and the
round's last push is applied before it ends: a lost worker loses only its
unsent gradients. The round's last block fetches too, and the worker keeps
those parameters (:class:`PrefetchedParams`) for its next round, which then
starts computing at once instead of waiting for a fetch that would cross
alone; they hold while the server's weights are those of the same
generation (``DownpourRuntime.fit_generation``: not across weights set
between epochs or ``fit`` calls). Not where a fetch leaves state on the server that
must stay in step with the pushes (``DelayCompensation``'s backup slots,
``max_staleness``'s clocks), nor for a user's ``train_step`` (it reads the
server's variables itself), nor in warmstart.

A model that overrides ``train_step`` has that step run instead, on the
server's variables (it reads them itself: ``n_fetch`` is 1); the gradients
it passes to ``self.optimizer.apply_gradients`` are taken by a
:class:`GradientCollector` and accumulated and pushed like Downpour's own;
its metric updates go to the round's local copy (:func:`user_local_step`).

Each push advances ``optimizer.iterations`` by the number of local steps it
carries, so that learning-rate schedules count training steps (batches) as
in plain Keras. Under ``mixed_float16`` (a ``LossScaleOptimizer``) each local
step scales its loss by the server's current loss scale and unscales its
gradients; the push is applied through the inner optimizer, and the loss
scale grows or halves on the server exactly as ``LossScaleOptimizer`` does
for accepted and rejected (non-finite) updates.
"""

import contextvars
import itertools
import math

import keras
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.cluster._ps_strategy import split_paths
from tfdist_ext.downpour import _staleness


def partition(model, strategy):
    """Places each replica's computation over ``strategy.model_devices``; the plan or ``None``."""
    if not strategy.model_devices:
        return None
    from tfdist_ext.model_parallel import apply_plan
    from tfdist_ext.model_parallel import plan_partition

    plan = plan_partition(model, strategy.model_devices)
    # Variables stay on the ps tasks; only the computation is placed.
    apply_plan(model, plan, place_variables=False)
    return plan


def round_input(batches):
    """Keras's batches for one round as one nest the round takes as its input.

    Each leaf is the batches' leaves concatenated along axis 0, beside the
    row offsets of each batch (batches may differ in size: an epoch's last
    one). The chief reads the batches from Keras's own epoch iterator, so
    what a round trains on is exactly what ``fit`` would train on.
    """
    for leaf in tf.nest.flatten(batches[0]):
        if not isinstance(leaf, (tf.Tensor, tf.RaggedTensor)):
            raise ValueError(
                "DownpourStrategy: fit's input has a "
                f"{type(leaf).__name__} feature; the workers take dense or ragged "
                "tensors. Convert it in the input pipeline (e.g. tf.sparse.to_dense)."
            )
    sizes = [_rows(tf.nest.flatten(b)[0]) for b in batches]
    offsets = tf.constant([0, *itertools.accumulate(sizes)], tf.int32)
    if len(batches) == 1:
        return batches[0], offsets
    return tf.nest.map_structure(lambda *leaves: tf.concat(leaves, 0), *batches), offsets


def _rows(tensor):
    """A batch's size: static for the chief's eager tensors, no op to run."""
    rows = tensor.shape[0]
    return int(tf.shape(tensor)[0]) if rows is None else int(rows)


def any_round_length(spec):
    """``spec`` of a round's input (:func:`round_input`) with the batch axis unknown.

    A round traced once with it takes rounds of any length and batches of
    any size (an epoch's last) without tracing again.
    """

    def relaxed(s):
        if isinstance(s, tf.RaggedTensorSpec):
            return tf.RaggedTensorSpec(
                [None, *s.shape[1:]], s.dtype, s.ragged_rank, s.row_splits_dtype
            )
        return tf.TensorSpec([None, *s.shape[1:]], s.dtype)

    return tf.nest.map_structure(relaxed, tf.nest.map_structure(tf.type_spec_from_value, spec))


@_staleness.graph_code
def batch_of(batches, index):
    """Batch ``index`` of a round's input (:func:`round_input`), on the worker."""
    data, offsets = batches
    start, stop = offsets[index], offsets[index + 1]
    return tf.nest.map_structure(lambda t: t[start:stop], data)


def metric_variables(model):
    """The model's metric variables, each once: what a round accumulates locally."""
    return list({id(v): v for v in model.metrics_variables}.values())


def write_back_assigned(scope, variables, start):
    """Writes to ``variables`` the values a step assigned them in ``scope``.

    ``start`` holds each one's value in the scope before the step; one the
    step did not assign (a frozen layer's weights, BatchNorm in inference
    mode) keeps that very tensor and is not written (such a write is a
    copy on the ``ps`` task that holds the variable, every step).
    """
    for v, old in zip(variables, start):
        new = scope.get_current_value(v)
        if new is not old:
            v.assign(new)


def keras_local_step(model, optimizer, loss_scale):
    """Keras's own training step on a local copy of the parameters.

    Returns ``(step, metric_vars)``: ``step(params, metric_values, data)``
    gives the gradients with respect to ``params`` (the model's trainable
    weights, mapped to those tensors by ``keras.StatelessScope``) and the
    new values of ``metric_vars``, the model's metric variables, also kept
    locally. The non-trainable weights the step assigns (BatchNorm
    statistics) are written where they live (:func:`write_back_assigned`).
    Used by Downpour's round and by elastic averaging's.
    """
    from tfdist_ext.model_parallel._placement import stage_gradients

    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    metric_vars = metric_variables(model)

    def step(params, metric_values, data):
        """Keras's step on the local copy ``params``: the gradients and the
        metrics' new state (local: see ``round_fn``)."""
        x, y, sample_weight = _integration.unpack_x_y_sample_weight(data)
        scale = loss_scale.read()
        with tf.GradientTape() as tape:
            tape.watch(params)
            mapping = list(zip(trainable, params))
            mapping += [(v, v.value) for v in non_trainable]
            # Keras's compiled loss updates its per-output loss trackers
            # (metric variables) inside compute_loss: they map to the local copy too.
            mapping += list(zip(metric_vars, metric_values))
            with (
                _integration.one_trace_at_a_time(),
                keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope,
            ):
                start = [scope.get_current_value(v) for v in non_trainable]
                y_pred = _integration.call_model(model, x, training=True)
                loss = _integration.compute_loss(model, x, y, y_pred, sample_weight)
                metric_values = [scope.get_current_value(v) for v in metric_vars]
            scaled = loss_scale.scale(optimizer, loss, scale)
        with stage_gradients():  # backward ops on their stage's device (model_devices)
            grads = tape.gradient(scaled, params)
        grads = [
            tf.zeros_like(p) if g is None else tf.convert_to_tensor(g)
            for g, p in zip(grads, params)
        ]
        grads = loss_scale.unscale(grads, scale)
        write_back_assigned(scope, non_trainable, start)
        batch = tf.shape(tf.nest.flatten(x)[0])[0]
        with keras.StatelessScope(state_mapping=list(zip(metric_vars, metric_values))) as scope:
            _integration.loss_tracker(model).update_state(loss, sample_weight=batch)
            model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return grads, [scope.get_current_value(v) for v in metric_vars]

    # Graph code, as Keras's own train step is: autograph leaves it as written.
    return _staleness.graph_code(step), metric_vars


def build_round(model, strategy, version, generation):
    """The tf.function one worker runs for a round of local steps.

    ``version`` is the server's update counter (a variable on a ``ps``
    task); staleness is measured in its units. ``generation`` is the
    counter (``DownpourRuntime.fit_generation``, advanced when weights
    change between epochs) that the parameters a worker prefetches for its
    next round belong to.
    """
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    if not trainable:
        raise ValueError("DownpourStrategy: the model has no trainable weights")
    optimizer = _built_optimizer(model, strategy)
    loss_scale = LossScale.of(optimizer)
    n_fetch, n_push = strategy.n_fetch, strategy.n_push
    param_bytes = sum(nbytes(v) for v in trainable)
    nt_bytes = sum(nbytes(v) for v in non_trainable)
    owner = _integration.overridden_step(model, "train_step")
    # Staleness policy (the fetch and the apply) and SSP clocks: _staleness.py.
    server = _staleness.server_side(strategy, trainable, version, owner is not None)
    bound = strategy.clock_bound()

    homes = [piece_homes(v) for v in trainable]

    def keras_before_fetch(worker, slot):
        """What must happen before a fetch, on the ps: the SSP wait, the backup copy."""
        with tf.control_dependencies(
            [bound.before_fetch(worker), server.before_fetch(worker, slot)]
        ):
            return tf.constant(True)

    def keras_read(worker, slot):
        """The parameters read on the ps, still there: ``(packed, source)``.

        ``packed`` is one tensor per ps task (``pack``); ``unpack`` on the
        worker is where they cross. ``source`` is ``(server version,
        slot)``: ``slot`` (0 or 1) is the worker's backup slot on the ps
        under ``DelayCompensation`` (see ``round_fn``).
        """
        # Every read on the ps is an op the next block waits for (its
        # stateful ops all are): the word that the reads finished must
        # reach the worker before the values leave the ps, not queue behind
        # their megabytes (see ``pack``). So the version is read first, the
        # parameters after it, and they leave once the worker has word of
        # the reads (``noted``, on the worker: a small message each way on
        # links otherwise idle at that moment). 1M params, 100 Mbit/s, n =
        # 5, 2 shards: 0.091 s a step without ``noted``, 0.088 with it.
        fetched = version.read_value()
        with tf.control_dependencies([fetched]):
            params = server.fetch(worker, slot)
        with tf.control_dependencies(tf.nest.flatten(params)):
            noted = tf.no_op()
        with tf.control_dependencies([noted]):
            return pack(params, homes, on_ps=True), (fetched, slot)

    def keras_unpack(packed):
        return unpack(packed, trainable, homes, on_ps=False)

    def version_only(worker, slot):
        """The user's step reads the parameters itself: only the source."""
        return [], (version.read_value(), slot)

    if owner is None:
        before_fetch, read, unpack_params = keras_before_fetch, keras_read, keras_unpack
        step, metric_vars = keras_local_step(model, optimizer, loss_scale)
    else:
        # The user's step reads the variables where they live (n_fetch is 1);
        # its metrics accumulate locally, as Keras's own step's do.
        _check_unsplit(trainable, owner)
        before_fetch, read = (lambda worker, slot: tf.constant(True)), version_only
        step, metric_vars = user_local_step(model, owner, trainable, non_trainable)
        unpack_params = list

    push, state_vars = make_push(
        strategy, loss_scale.target(optimizer), trainable, param_bytes, loss_scale, server, version
    )
    # The next round's parameters, prefetched while the last block computes,
    # where a fetch leaves nothing on the server to keep in step with it (a
    # DelayCompensation backup slot, an SSP clock tick) and there is a copy to
    # keep (Downpour's own step).
    carry = None
    if owner is None and server.fetch_is_a_read and bound.s is None:
        carry = PrefetchedParams(strategy, trainable, generation)

    block = math.gcd(n_fetch, n_push)
    # Only round_fn's and local_steps' loops and conds are on tensors. What
    # they call is graph code, which autograph leaves as written, as Keras
    # leaves its own train step: converting it all made a round's first trace
    # take seconds.
    graph_code = _staleness.graph_code
    before_fetch, read, unpack_params = map(graph_code, (before_fetch, read, unpack_params))
    push = graph_code(push)

    def local_steps(batches, first, count, params, accum, metric_values):
        """Steps ``first..first+count`` of the round on ``params``; the
        gradients add to ``accum``.

        Only the worker's own ops (and a user's ``train_step``) run in this
        inner loop, so the ``ps`` tasks take no part in each step's loop
        control: only the block loop around it reaches them.
        """
        for i in tf.range(count):
            data = batch_of(batches, first + i)
            grads, metric_values = strategy.run(step, args=(params, metric_values, data))
            accum = [a + g for a, g in zip(accum, grads)]
        return accum, metric_values

    @tf.function
    def round_fn(batches, worker, num_steps, prefetch=True):
        """``num_steps`` local steps; ``prefetch``: start from and keep prefetched parameters."""
        state = tf.nest.map_structure(lambda v: v.read_value(), state_vars)
        # The metrics accumulate on a local copy; the round adds what it
        # changed to the real variables once, at its end (an atomic add, so
        # concurrent rounds lose no update), instead of a read and a write
        # on the ps at every step.
        metrics_start = [tf.convert_to_tensor(v.value) for v in metric_vars]
        metric_values = metrics_start
        zeros = [tf.zeros(v.shape, v.dtype) for v in trainable]
        # A fetch's source: the server version it read and its backup slot,
        # the round's fetch count mod 2. Under DelayCompensation the fetch
        # copies the parameters into that slot of the worker's two backups on
        # the ps, and the push applies against the slot its gradient was
        # computed from. The outbox computed from fetch k is pushed at the
        # start of the next block, before that block's prefetch: at most
        # fetch k + 1 (one per block, the other slot) comes between, so fetch
        # k + 2 never overwrites the slot of a push still to be applied.
        slot = tf.constant(0, tf.int64)

        def first_fetch():
            with tf.control_dependencies([bound.start(worker)]):
                ready = before_fetch(worker, slot)
            with tf.control_dependencies([ready]):
                packed, (fetched, _) = read(worker, slot)
            return unpack_params(packed), fetched, tf.constant(1, tf.int64)

        started_prefetched = tf.constant(False)
        carry_reads = []
        if carry is None:
            params, fetched, fetches = first_fetch()
        else:
            # The parameters this worker prefetched in its last round of this
            # generation, if any: no fetch crosses alone before the first block.
            started_prefetched = tf.logical_and(carry.valid(), prefetch)
            held = carry.read()  # outside the cond: a per-worker variable is
            # read where the function binds it to the worker's copy
            params, fetched, fetches = tf.cond(started_prefetched, lambda: held, first_fetch)
            carry_reads = [started_prefetched, held[1], *held[0]]
        source = (fetched, slot)
        prefetched, prefetched_source = params, source
        accum, carried = zeros, tf.constant(0, tf.int64)  # local steps in accum
        # A push in flight: the gradient of `outbox_steps` steps on parameters
        # from `outbox_source` (the latest fetch, when it spans several).
        outbox, outbox_steps, outbox_source = zeros, tf.constant(0, tf.int64), source
        sent = tf.constant(0, tf.int64)
        pushes = tf.constant(0, tf.int64)
        rejected = tf.constant(0, tf.int64)
        applied = tf.constant(0, tf.int64)
        staleness = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
        done = tf.constant(0, tf.int32)
        # Blocks of gcd(n_fetch, n_push) steps. While a block computes, the
        # previous block's push is applied on the ps, and the parameters for
        # the next fetch point are read after it (DistBelief's background
        # push and fetch): a replica computes without its own last push, one
        # push of staleness that the version counter measures like any
        # other. A last, empty block applies the round's last push, so
        # nothing is in flight when the round ends.
        while done < num_steps or outbox_steps > 0:
            if outbox_steps > 0:
                accepted, before, state, nbytes_sent = push(
                    outbox, state, outbox_steps, (worker, *outbox_source)
                )
                sent += nbytes_sent
                if accepted:
                    staleness = staleness.write(staleness.size(), before - outbox_source[0])
                    pushes += 1
                    applied += outbox_steps
                else:
                    rejected += 1
            count = tf.minimum(block, num_steps - done)
            done += count
            fetch_due = done % n_fetch == 0 and done < num_steps
            if carry is not None:
                # The last block fetches too: the next round's parameters.
                fetch_due = done % n_fetch == 0 and count > 0 and (done < num_steps or prefetch)
            # The fetch: the ps side's work when due (stateful), then reads on
            # the ps in every block (no transfer), then the crossing, only
            # when due, in a cond of no stateful op. The crossing is then
            # not part of the block's stateful work, which the next block
            # waits for: the next push crosses while this fetch still does.
            ready = tf.constant(True)
            if fetch_due:
                ready = before_fetch(worker, fetches % 2)
            with tf.control_dependencies([ready]):
                packed, packed_source = read(worker, fetches % 2)
            if fetch_due:
                prefetched, prefetched_source = unpack_params(packed), packed_source
                fetches += 1
            accum, metric_values = local_steps(
                batches, done - count, count, params, accum, metric_values
            )
            carried += tf.cast(count, tf.int64)
            outbox_steps = tf.constant(0, tf.int64)
            if done % n_push == 0 or done == num_steps:
                outbox, outbox_steps, outbox_source = accum, carried, source
                accum, carried = zeros, tf.constant(0, tf.int64)
            if fetch_due:
                params, source = prefetched, prefetched_source
        steps = tf.cast(num_steps, tf.int64)
        # Per-worker compressor state (error-feedback residuals, momenta)
        # carries over to this worker's next round. PerWorkerVariables get
        # no automatic control dependencies: tie the writes to the outputs.
        saved = [v.assign(t) for v, t in zip(tf.nest.flatten(state_vars), tf.nest.flatten(state))]
        saved.append(bound.stop(worker))
        if carry is not None:
            # Kept when the last block fetched (a round of whole fetch blocks).
            kept = tf.logical_and(num_steps > 0, num_steps % n_fetch == 0)
            kept = tf.logical_and(kept, prefetch)
            # After this round's reads of the same per-worker variables: they
            # get no automatic control dependencies, and the generation a
            # keep writes is known from the round's start, so without this
            # the write could come first and the round take as prefetched
            # parameters it never fetched (seen about once in ten fits).
            with tf.control_dependencies(carry_reads):
                saved += carry.keep(kept, prefetched, prefetched_source[0])
        steps = after_writes(steps, saved, metric_vars, metric_values, metrics_start)
        return {
            "worker": worker,
            "steps": steps,
            "applied_steps": applied,
            "pushes": pushes,
            "fetches": fetches,
            "prefetched": tf.cast(started_prefetched, tf.int64),
            "rejected": rejected,
            "staleness": staleness.stack(),
            "push_bytes": sent,
            "fetch_bytes": fetches * param_bytes + steps * 2 * nt_bytes,
        }

    return round_fn


class PrefetchedParams:
    """The parameters a worker fetched for its next round, kept on the worker.

    DistBelief's replicas fetch in the background, round or no round. Here
    the round's last block fetches the parameters once more while it
    computes (after the round's second-last push is applied, as every
    block's fetch), and the round keeps them in per-worker variables with
    the generation they belong to; the worker's next round of the same
    generation starts from them instead of from a fetch that would cross
    alone, before any step can compute. They miss the round's last push and
    whatever the server applied between the two rounds: that staleness is
    measured like any other. A worker that is lost or restarted loses only
    this copy (its next round fetches).
    """

    def __init__(self, strategy, trainable, generation):
        self.generation = generation
        with strategy.scope():
            self.params = [
                tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, per_worker_variable=True)
                for v in trainable
            ]
            self.version = tf.Variable(
                tf.constant(-1, tf.int64), trainable=False, per_worker_variable=True
            )
            self.born = tf.Variable(
                tf.constant(-1, tf.int64), trainable=False, per_worker_variable=True
            )

    @_staleness.graph_code
    def valid(self):
        """Whether this worker holds parameters prefetched in the current generation."""
        return tf.equal(self.born.read_value(), self.generation.read_value())

    @_staleness.graph_code
    def read(self):
        """``(params, the server version they were read at, fetches: 0)``."""
        return (
            [v.read_value() for v in self.params],
            self.version.read_value(),
            tf.constant(0, tf.int64),
        )

    @_staleness.graph_code
    def keep(self, kept, params, version):
        """The writes that keep ``params`` (read at ``version``) if ``kept``, else drop them."""
        born = tf.where(kept, self.generation.read_value(), tf.constant(-1, tf.int64))
        writes = [v.assign(p) for v, p in zip(self.params, params)]
        return writes + [self.version.assign(version), self.born.assign(born)]


@_staleness.graph_code
def after_writes(steps, writes, metric_vars, metric_values, metrics_start):
    """``steps``, returned only after ``writes`` and the round's metric update.

    The round's metrics, kept locally, are added to the model's metric
    variables (an atomic add, so concurrent rounds lose no update). Writes
    to per-worker variables get no automatic control dependencies: tying
    them to the round's output makes them run.
    """
    writes = list(writes) + [
        v.value.assign_add(new - old)
        for v, new, old in zip(metric_vars, metric_values, metrics_start)
    ]
    with tf.control_dependencies(writes):
        return tf.identity(steps)


def user_local_step(model, owner, trainable, non_trainable):
    """The user's ``train_step`` (``owner``'s) as a local step; ``(step, metric_vars)``.

    ``step(params, metric_values, data)`` runs it on the server's variables
    (``params`` is unused: the step reads them itself) and gives the
    gradients its ``optimizer.apply`` handed to a :class:`GradientCollector`.
    Its metric updates go to the round's local copy ``metric_values``, as
    Keras's own step's do (``keras_local_step``): a Keras variable's
    ``assign_add`` is a read and a write, so two workers updating the
    model's metric variables at once lose each other's updates. Its
    non-trainable weights (BatchNorm statistics) are written where they
    live; any other variable it assigns is refused when the step is traced.
    """
    metric_vars = metric_variables(model)
    known = {id(v) for v in metric_vars + non_trainable}

    def step(params, metric_values, data):
        mapping = list(zip(metric_vars, metric_values)) + [(v, v.value) for v in non_trainable]
        with _integration.one_trace_at_a_time(), GradientCollector(model, trainable) as collector:
            with keras.StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
                start = [scope.get_current_value(v) for v in non_trainable]
                model.train_step(data)
        _check_assigned(model, owner, set(scope.state_mapping) - known)
        write_back_assigned(scope, non_trainable, start)
        return collector.gradients(), [scope.get_current_value(v) for v in metric_vars]

    # Keras runs a train_step unconverted by autograph; so does the round.
    return _staleness.graph_code(step), metric_vars


def _check_assigned(model, owner, unknown):
    """Refuses a ``train_step`` that assigned variables other than metrics and non-trainables."""
    if not unknown:
        return
    optimizer = model.optimizer.variables if model.optimizer is not None else []
    names = [v.path for v in list(model.variables) + list(optimizer) if id(v) in unknown]
    what = ", ".join(names) if names else "a variable that is not the model's"
    raise ValueError(
        f"DownpourStrategy: {owner.__name__}.train_step assigned {what} directly. "
        "Under Downpour the trainable weights live on the parameter servers and change "
        "only through self.optimizer.apply_gradients(...) (the pushed gradients); "
        "metrics and non-trainable weights may be updated in train_step."
    )


def _check_unsplit(trainable, owner):
    split = split_paths(trainable)
    if split:
        raise ValueError(
            f"DownpourStrategy: {owner.__name__}.train_step cannot differentiate "
            f"{', '.join(split)}: split across the ps tasks (min_shard_bytes), it has no "
            "single handle for a GradientTape. Raise min_shard_bytes above the largest "
            "weight's size, or put the custom loss in compute_loss instead of train_step."
        )


class GradientCollector:
    """Where a user's ``train_step`` hands its gradients to Downpour.

    Horovod's ``DistributedOptimizer`` idea: while a worker traces the
    user's step, ``self.optimizer.apply_gradients(...)``/``apply(...)`` of
    the model's optimizer does not update anything; the gradients are
    collected here (unscaled by the loss scale under ``mixed_float16``, as
    ``LossScaleOptimizer.apply`` would) and the round accumulates and pushes
    them every ``n_push`` steps. ``DownpourStrategy._tfdist_apply`` receives
    the calls (see ``tfdist_ext._integration.install_optimizer_hooks``).
    """

    _active = contextvars.ContextVar("downpour_gradient_collector", default=None)

    def __init__(self, model, trainable):
        self._model = model
        self._trainable = trainable
        self._index = {id(v): i for i, v in enumerate(trainable)}
        self._grads = [None] * len(trainable)
        self._applied = False
        self._token = None

    @classmethod
    def active(cls):
        """The collector of the step being traced in this thread, or ``None``."""
        return cls._active.get()

    def __enter__(self):
        self._token = self._active.set(self)
        return self

    def __exit__(self, *exc_info):
        self._active.reset(self._token)

    def add(self, optimizer, grads, variables):
        """Takes ``optimizer.apply(grads, variables)`` of the user's step."""
        name = type(self._model).__name__
        if optimizer is not self._model.optimizer:
            raise ValueError(
                f"DownpourStrategy: {name}.train_step applied an optimizer other than "
                "the model's compiled one; Downpour applies model.optimizer on the "
                "parameter servers: call self.optimizer.apply_gradients(...)"
            )
        scale = None
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = tf.convert_to_tensor(optimizer.dynamic_scale.value)
        variables = self._trainable if variables is None else list(variables)
        for g, v in zip(grads, variables):
            if g is None:
                continue
            i = self._index.get(id(v))
            if i is None:
                raise ValueError(
                    f"DownpourStrategy: {name}.train_step applied a gradient to "
                    f"{getattr(v, 'path', v)!r}, which is not a trainable weight of the model"
                )
            g = tf.convert_to_tensor(g)
            if scale is not None:
                g = g / tf.cast(scale, g.dtype)
            self._grads[i] = g if self._grads[i] is None else self._grads[i] + g
        self._applied = True

    def gradients(self):
        """The step's gradient of every trainable weight (zeros where it gave none)."""
        if not self._applied:
            raise ValueError(
                f"DownpourStrategy: {type(self._model).__name__}.train_step did not call "
                "self.optimizer.apply_gradients(...) (or apply): Downpour pushes the "
                "gradients given there, so nothing would be trained"
            )
        return [
            tf.zeros(v.shape, v.dtype) if g is None else g
            for g, v in zip(self._grads, self._trainable)
        ]


def _built_optimizer(model, strategy):
    """The compiled optimizer, built (slots on the ``ps`` tasks) before the round is traced."""
    optimizer = model.optimizer
    if optimizer is None:
        raise ValueError("DownpourStrategy: compile the model before fit()")
    if not optimizer.built:
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    return optimizer


class LossScale:
    """Dynamic loss scaling of a ``keras.optimizers.LossScaleOptimizer`` under Downpour.

    Keras's ``LossScaleOptimizer.apply`` needs a replica context with
    ``merge_call``; a Downpour push is applied on the server from a
    cross-replica context. So the worker does the scaling (scale the loss by
    the server's current ``dynamic_scale``, unscale the gradients with the
    same value), the push goes through ``inner_optimizer``, and the server
    updates ``dynamic_scale``/``step_counter`` by Keras's rule: halve on a
    non-finite (rejected) push, double after ``dynamic_growth_steps``
    accepted ones. Other optimizers: ``optimizer.scale_loss`` (their
    ``loss_scale_factor``, unscaled by ``apply``), nothing else.
    """

    def __init__(self, optimizer=None):
        self.optimizer = optimizer

    @classmethod
    def of(cls, optimizer):
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            return cls(optimizer)
        return cls()

    def target(self, optimizer):
        """The optimizer a push applies."""
        return optimizer if self.optimizer is None else self.optimizer.inner_optimizer

    def read(self):
        if self.optimizer is None:
            return None
        return tf.convert_to_tensor(self.optimizer.dynamic_scale.value)

    def scale(self, optimizer, loss, scale):
        if scale is None:
            return optimizer.scale_loss(loss)
        return loss * tf.cast(scale, loss.dtype)

    def unscale(self, grads, scale):
        if scale is None:
            return grads
        return [g / tf.cast(scale, g.dtype) for g in grads]

    def after_accepted(self):
        if self.optimizer is None:
            return
        counter = self.optimizer.step_counter.value
        scale = self.optimizer.dynamic_scale.value
        grow = tf.equal(counter.read_value(), self.optimizer.dynamic_growth_steps - 1)
        tf.cond(
            grow,
            lambda: tf.group(counter.assign(0), scale.assign(scale.read_value() * 2.0)),
            lambda: tf.group(counter.assign_add(1)),
        )

    def after_rejected(self):
        if self.optimizer is None:
            return
        counter = self.optimizer.step_counter.value
        scale = self.optimizer.dynamic_scale.value
        tf.group(counter.assign(0), scale.assign(scale.read_value() * 0.5))


def make_push(strategy, optimizer, trainable, param_bytes, loss_scale, server, version):
    """``push(accum, state, steps, origin) -> (accepted, before, state, bytes_sent)`` and the state variables.

    Every push is checked for NaN/Inf and ``optimizer`` is applied only if
    all of it is finite: a dense push on the worker, before it crosses; a
    compressed one on each ``ps`` task, after decompression. An applied
    push advances ``optimizer.iterations`` by the ``steps`` it carries, and
    ``version`` (the server's update counter) by one, on the ``ps`` task
    that holds it, with no word from the worker in between; ``before`` is
    its value before (-1 for a rejected push).
    Without compression the dense gradient is what
    crosses the wire and the optimizer's per-variable updates run on the
    owning ``ps`` task. With a compressor the worker sends the compressed
    wire form, the owning ``ps`` task decompresses it, and the compressor's
    state (error-feedback residuals, DGC momenta) stays on the worker in
    per-worker variables; a rejected push leaves that state unchanged. A
    dense push sends one tensor per ``ps`` task (the concatenated gradients
    of the variables it owns). ``server`` (``_staleness.server_side``)
    applies the optimizer, given ``origin``: the pushing worker and the
    server version its gradients were computed from and that fetch's
    backup slot.
    """
    compressor = strategy.compression
    iterations = optimizer.iterations.value
    homes = [home(v) for v in trainable]

    def apply(grads, steps, origin):
        # Cross-replica context: each variable's update runs on the ps task
        # that owns it (extended.update colocates; a split one, piece by piece
        # on each piece's task). Keras counts 1; the push carries `steps`.
        with strategy.extended.per_shard_updates(optimizer, trainable):
            server.apply(optimizer, grads, *origin)
        with tf.control_dependencies([iterations.assign_add(steps - 1)]):
            loss_scale.after_accepted()
        # The version advances once the push is applied, on its ps: deciding
        # it on the worker took a crossing each way, the second after this
        # push's fetch had begun to cross (see pack). After the push's writes:
        # reads of every piece, which follow them.
        with tf.control_dependencies(tf.nest.flatten(_staleness.read_pieces(trainable))):
            before = version.assign_add(1) - 1
        return tf.constant(True), before

    def reject():
        loss_scale.after_rejected()
        return tf.constant(False), tf.constant(-1, tf.int64)

    def all_finite(tensors, devices):
        checks = []
        for t, device in zip(tensors, devices):
            with tf.device(device):
                checks.append(tf.reduce_all(tf.math.is_finite(t)))
        return tf.reduce_all(checks)

    def checked_apply(accepted, grads, steps, origin):
        return tf.cond(accepted, lambda: apply(grads, steps, origin), reject)

    if compressor is None:

        def push(accum, state, steps, origin):
            # Checked on the worker, before it crosses: the crossing waits
            # for no answer from the ps (one that would queue behind a fetch
            # in flight, see round_fn).
            accepted = all_finite(accum, [None] * len(accum))
            grads = one_transfer_per_task(accum, homes, to_ps=True)
            _, before = checked_apply(accepted, grads, steps, origin)
            return accepted, before, state, tf.constant(param_bytes, tf.int64)

        return push, []

    with strategy.scope():
        state_vars = [
            tf.nest.map_structure(
                lambda t: tf.Variable(t, trainable=False, per_worker_variable=True),
                compressor.init(v.shape, v.dtype),
            )
            for v in trainable
        ]

    def push(accum, state, steps, origin):
        step = version.read_value()
        wires, candidate = [], []
        for a, s in zip(accum, state):
            wire, s = compressor.compress(a, s, step)
            wires.append(wire)
            candidate.append(s)
        grads = []
        for wire, device, a in zip(wires, homes, accum):
            with tf.device(device):
                grads.append(compressor.decompress(wire, a.shape, a.dtype))
        # Checked on each ps task after decompression: the wire form can
        # overflow where the gradient did not (fp16).
        accepted, before = checked_apply(all_finite(grads, homes), grads, steps, origin)
        if tf.nest.flatten(candidate):
            state = tf.cond(accepted, lambda: candidate, lambda: state)
        return accepted, before, state, tf.add_n([compressor.wire_bytes(w) for w in wires])

    return push, state_vars


def home(variable):
    """The ``ps`` device holding ``variable``, or ``None`` when it is split across them."""
    value = variable.value
    if isinstance(value, _integration.ShardedVariable):
        return None  # split: checked and decompressed on the worker
    return value.device


def piece_homes(variable):
    """:func:`home`, but for a variable split across the ``ps`` tasks the
    list of its pieces' devices (a fetch reads it piece by piece)."""
    value = variable.value
    if isinstance(value, _integration.ShardedVariable):
        return [piece.device for piece in value.variables]
    return value.device


def one_transfer_per_task(tensors, homes, to_ps):
    """``tensors`` as they arrive after crossing between the worker and the ``ps`` tasks.

    ``homes[i]`` is the ``ps`` device of ``tensors[i]`` (``None``: stays
    as it is). The tensors of one task (and dtype) cross as one
    concatenated tensor, split on arrival: to the ``ps`` tasks when
    ``to_ps`` (a push), from them otherwise (a fetch). A transfer per
    variable costs more than its bytes.
    """
    return unpack(pack(tensors, homes, on_ps=not to_ps), tensors, homes, on_ps=to_ps)


def pack(tensors, homes, on_ps):
    """The sending half of :func:`one_transfer_per_task`.

    The tensors of each ``ps`` task (and dtype) concatenated into one, on
    that task when ``on_ps``, on the worker otherwise; the others as they
    are, but copied on their ``ps`` task when ``on_ps`` (a list of
    devices in ``homes``: a split variable's pieces, each on its own). The
    values cross where :func:`unpack` uses them.

    From the ``ps`` tasks, every value crosses from a stateless op that
    runs after its read (the concat, or a ``Snapshot`` copy). Every
    stateful op of a block (a read, a ``DeepCopy``) is one the next block
    waits for, and the word that it finished crosses to the worker as a
    small message on the connection the values take: sent with them, it
    can queue behind their megabytes, and then the next push cannot cross
    while this fetch does. Sent straight from their reads, a split
    weight's pieces did that in every block (one worker, 2 shards, 100
    Mbit/s: 1.13-1.28 s a step); copied by the stateful ``DeepCopy``, in
    some blocks (0.94-1.08 s; 1M params: 0.116 s, against 0.094 s with
    ``Snapshot``). The round also sends the word before the values
    (``build_round``'s fetch).
    """
    groups = _task_groups(tensors, homes)
    grouped = {i for _, indices in groups for i in indices}
    packed = []
    for device, indices in groups:
        with tf.device(device if on_ps else None):
            packed.append(tf.concat([tf.reshape(tensors[i], [-1]) for i in indices], 0))
    for i, t in enumerate(tensors):
        if i not in grouped:
            packed.append(_copied(t, homes[i]) if on_ps else t)
    return packed


def _copied(tensor, home):
    """``tensor`` copied on ``home`` (a list of devices: each piece of ``tensor`` on its own)."""
    if home is None:
        return tensor
    if isinstance(home, list):
        return [_copied(t, h) for t, h in zip(tensor, home)]
    with tf.device(home):
        return tf.raw_ops.Snapshot(input=tensor)  # stateless, unlike DeepCopy: see pack


def unpack(packed, like, homes, on_ps):
    """The receiving half: ``pack(tensors, homes, ...)`` split back into tensors shaped as ``like``.

    A list in place of a tensor (the pieces of a variable split across the
    ``ps`` tasks) is concatenated here.
    """
    groups = _task_groups(like, homes)
    grouped = {i for _, indices in groups for i in indices}
    tensors = [None] * len(like)
    for flat, (device, indices) in zip(packed, groups):
        with tf.device(device if on_ps else None):
            parts = tf.split(flat, [like[i].shape.num_elements() for i in indices])
            for i, part in zip(indices, parts):
                tensors[i] = tf.reshape(part, like[i].shape)
    rest = iter(packed[len(groups) :])
    tensors = [next(rest) if i not in grouped else t for i, t in enumerate(tensors)]
    return [tf.concat(t, 0) if isinstance(t, list) else t for t in tensors]


def _task_groups(tensors, homes):
    """``[(device, indices)]``: the tensors of one ``ps`` task and dtype, where there are several."""
    groups = {}
    for i, device in enumerate(homes):
        if isinstance(device, str):
            groups.setdefault((device, tf.as_dtype(tensors[i].dtype)), []).append(i)
    return [(device, indices) for (device, _), indices in groups.items() if len(indices) > 1]


def nbytes(variable):
    return int(variable.shape.num_elements()) * tf.as_dtype(variable.dtype).size
