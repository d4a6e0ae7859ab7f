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
block computes, the previous block's push is applied; a block that fetches
reads once that push is applied (by default), or, with
``background_fetch``, reads the parameters for the next fetch point while
the block computes (DistBelief's background fetch; one push of staleness,
measured). The parameters are read on the ``ps`` tasks in every block and
cross only when a fetch is due, in a cond of no stateful op: the next
block's push, checked on the worker, crosses while they do. The metrics
accumulate on a local copy too, added to the model's metric variables at
the round's end. Round boundaries fall exactly where both a fetch and a
push are due and the round's last push is applied before it ends: a lost
worker loses only its unsent gradients. With the background fetch the
round's last block fetches too, and the worker keeps those parameters
(:class:`WorkerCopy`) for its next round, which then starts computing at
once instead of waiting for a fetch that would cross alone; they hold
while the server's weights are those of the same generation
(``DownpourRuntime.fit_generation``: not across weights set between
epochs or ``fit`` calls). Not where a fetch leaves state on the server
that must stay in step with the pushes (``DelayCompensation``'s backup slots,
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
from tfdist_ext._ps_strategy import split_paths
from tfdist_ext.downpour import _staleness
from tfdist_ext.model_parallel import apply_plan
from tfdist_ext.model_parallel import plan_partition
from tfdist_ext.model_parallel._placement import stage_gradients


def partition(model, strategy):
    """Places each replica's computation over ``strategy.model_devices``; the plan or ``None``."""
    if not strategy.model_devices:
        return None
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
    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    metric_vars = metric_variables(model)

    def step(params, metric_values, data):
        """Keras's step on the local copy ``params``: the gradients and the
        metrics' new state (local: see :meth:`DownpourRound.run`)."""
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
    """The tf.function one worker runs for a round of local steps (:class:`DownpourRound`)."""
    return tf.function(DownpourRound(model, strategy, version, generation).run)


class DownpourRound:
    """A worker's round: fetch, blocks of local steps, push (see the module's docstring).

    ``version`` is the server's update counter (a variable on a ``ps``
    task); staleness is measured in its units. ``generation`` is the
    counter (``DownpourRuntime.fit_generation``, advanced when weights
    change between epochs) that the parameters a worker prefetches for its
    next round belong to.

    :meth:`run` trains in blocks of gcd(n_fetch, n_push) steps. While a
    block computes, the previous block's push is applied on the ps, and the
    parameters for the next fetch point are read after it (DistBelief's
    background push and fetch): a replica computes without its own last
    push, one push of staleness that the version counter measures like any
    other. Without ``background_fetch`` a block that fetches reads once the
    previous block's push is applied and computes on what it read: no push
    of its own is missing, and the fetch no longer hides behind compute. A
    last, empty block applies the round's last push, so nothing is
    in flight when the round ends. The fetch's reads on the ps run in every
    block (no transfer); the crossing only when due, in a cond of no
    stateful op, so the next push crosses while this fetch still does.

    Only :meth:`run`, :meth:`send`, :meth:`fetch_due` and :meth:`local_steps`
    hold loops, conds or ``and``/``or`` on tensors (autograph converts them);
    what they call is graph code.

    A fetch's source is the server version it read and its backup slot, the
    round's fetch count mod 2. Under ``DelayCompensation`` the fetch copies
    the parameters into that slot of the worker's two backups on the ps, and
    the push applies against the slot its gradient was computed from. The
    outbox computed from fetch k is pushed at the start of the next block,
    before that block's prefetch: at most fetch k + 1 (one per block, the
    other slot) comes between, so fetch k + 2 never overwrites the slot of a
    push still to be applied.
    """

    def __init__(self, model, strategy, version, generation):
        trainable = list(model.trainable_variables)
        non_trainable = list(model.non_trainable_variables)
        if not trainable:
            raise ValueError("DownpourStrategy: the model has no trainable weights")
        self.strategy, self.version, self.trainable = strategy, version, trainable
        optimizer = _built_optimizer(model, strategy)
        loss_scale = LossScale.of(optimizer)
        self.n_fetch, self.n_push = strategy.n_fetch, strategy.n_push
        self.block = math.gcd(self.n_fetch, self.n_push)
        self.param_bytes = sum(nbytes(v) for v in trainable)
        self.nt_bytes = sum(nbytes(v) for v in non_trainable)
        owner = _integration.overridden_step(model, "train_step")
        self.user_step = owner is not None
        # Staleness policy (the fetch and the apply) and SSP clocks: _staleness.py.
        self.server = _staleness.server_side(strategy, trainable, version, self.user_step)
        self.bound = strategy.clock_bound()
        self.homes = [piece_homes(v) for v in trainable]
        if owner is None:
            self.step, self.metric_vars = keras_local_step(model, optimizer, loss_scale)
        else:
            # The user's step reads the variables where they live (n_fetch is 1);
            # its metrics accumulate locally, as Keras's own step's do.
            _check_unsplit(trainable, owner)
            self.step, self.metric_vars = user_local_step(model, owner, trainable, non_trainable)
        push, self.state_vars = make_push(
            strategy,
            loss_scale.target(optimizer),
            trainable,
            self.param_bytes,
            loss_scale,
            self.server,
            version,
        )
        self.push = _staleness.graph_code(push)
        # The next round's parameters, prefetched while the last block computes,
        # where a fetch leaves nothing on the server to keep in step with it (a
        # DelayCompensation backup slot, an SSP clock tick) and there is a copy to
        # keep (Downpour's own step).
        self.carry = None
        self.background = strategy.background_fetch
        if (
            self.background
            and owner is None
            and self.server.fetch_is_a_read
            and self.bound.s is None
        ):
            self.carry = WorkerCopy(strategy, trainable, tf.int64)
        self.generation = generation

    @_staleness.graph_code
    def before_fetch(self, worker, slot):
        """What must happen before a fetch, on the ps: the SSP wait, the backup copy."""
        if self.user_step:
            return tf.constant(True)
        ops = [self.bound.before_fetch(worker), self.server.before_fetch(worker, slot)]
        with tf.control_dependencies(ops):
            return tf.constant(True)

    @_staleness.graph_code
    def read(self, worker, slot):
        """The parameters read on the ps, still there: ``(packed, source)``.

        ``packed`` is one tensor per ps task (``pack``); :meth:`unpack_params`
        on the worker is where they cross. ``source`` is ``(server version,
        slot)``. A user's step reads the parameters itself: only the source.
        """
        if self.user_step:
            return [], (self.version.read_value(), slot)
        # Every read on the ps is an op the next block waits for (its
        # stateful ops all are): the word that the reads finished must
        # reach the worker before the values leave the ps, not queue behind
        # their megabytes (see ``pack``). So the version is read first, the
        # parameters after it, and they leave once the worker has word of
        # the reads (``noted``, on the worker: a small message each way on
        # links otherwise idle at that moment).
        fetched = self.version.read_value()
        with tf.control_dependencies([fetched]):
            params = self.server.fetch(worker, slot)
        with tf.control_dependencies(tf.nest.flatten(params)):
            noted = tf.no_op()
        with tf.control_dependencies([noted]):
            return pack(params, self.homes, on_ps=True), (fetched, slot)

    @_staleness.graph_code
    def unpack_params(self, packed):
        if self.user_step:
            return list(packed)
        return unpack(packed, self.trainable, self.homes, on_ps=False)

    @_staleness.graph_code
    def first_fetch(self, worker, slot):
        """The round's first parameters: ``(params, server version, fetches)``."""
        with tf.control_dependencies([self.bound.start(worker)]):
            ready = self.before_fetch(worker, slot)
        with tf.control_dependencies([ready]):
            packed, (fetched, _) = self.read(worker, slot)
        return self.unpack_params(packed), fetched, tf.constant(1, tf.int64)

    @_staleness.graph_code
    def start(self, worker, slot, prefetch):
        """``(params, fetched, fetches, started_prefetched, carry_reads)``: the
        parameters this worker prefetched in its last round of this
        generation, if any (no fetch crosses alone before the first block),
        or a fetch."""
        if self.carry is None:
            return (*self.first_fetch(worker, slot), tf.constant(False), [])
        # Read outside the cond: a per-worker variable is read where the
        # function binds it to the worker's copy.
        held, version, born = self.carry.read()
        valid = tf.equal(born, self.generation.read_value())
        started_prefetched = tf.logical_and(valid, prefetch)
        params, fetched, fetches = tf.cond(
            started_prefetched,
            lambda: (held, version, tf.constant(0, tf.int64)),
            lambda: self.first_fetch(worker, slot),
        )
        return params, fetched, fetches, started_prefetched, [started_prefetched, version, *held]

    def local_steps(self, batches, first, count, params, accum, metric_values):
        """Steps ``first..first+count`` of the round on ``params``; the
        gradients add to ``accum``.

        Only the worker's own ops (and a user's ``train_step``) run in this
        inner loop, so the ``ps`` tasks take no part in each step's loop
        control: only the block loop around it reaches them.
        """
        for i in tf.range(count):
            data = batch_of(batches, first + i)
            grads, metric_values = self.strategy.run(self.step, args=(params, metric_values, data))
            accum = [a + g for a, g in zip(accum, grads)]
        return accum, metric_values

    def send(self, outbox, steps, origin, state, counts, staleness):
        """Pushes ``outbox``, the gradient of ``steps`` steps from ``origin``
        (the worker, the server version and slot of the fetch they used).

        ``counts`` is ``(bytes sent, pushes, rejected, steps applied)``;
        returns the compressor ``state``, ``counts`` and ``staleness`` after it.
        """
        sent, pushes, rejected, applied = counts
        accepted, before, state, nbytes_sent = self.push(outbox, state, steps, origin)
        sent += nbytes_sent
        if accepted:
            staleness = staleness.write(staleness.size(), before - origin[1])
            pushes += 1
            applied += steps
        else:
            rejected += 1
        # `before` comes out of the push's applying (-1 if rejected): what a
        # fetch that must follow the push waits for.
        return state, (sent, pushes, rejected, applied), staleness, before

    def fetch_due(self, start, count, num_steps, prefetch):
        """Whether the block of ``count`` steps from step ``start`` fetches."""
        if not self.background:
            # For itself, after its own last push (the round's start fetched).
            return start % self.n_fetch == 0 and start > 0 and count > 0
        done = start + count  # in the background, for the steps from `done`
        if self.carry is None:
            return done % self.n_fetch == 0 and done < num_steps
        # The last block fetches too: the next round's parameters.
        return done % self.n_fetch == 0 and count > 0 and (done < num_steps or prefetch)

    def run(self, batches, worker, num_steps, prefetch=True):
        """``num_steps`` local steps; ``prefetch``: start from and keep prefetched parameters."""
        state = tf.nest.map_structure(lambda v: v.read_value(), self.state_vars)
        # The metrics accumulate on a local copy, added to the real variables
        # once, at the round's end (an atomic add: concurrent rounds lose no update).
        metrics_start = [tf.convert_to_tensor(v.value) for v in self.metric_vars]
        metric_values = metrics_start
        zeros = [tf.zeros(v.shape, v.dtype) for v in self.trainable]
        no_steps = tf.constant(0, tf.int64)
        slot = tf.constant(0, tf.int64)
        params, fetched, fetches, started_prefetched, carry_reads = self.start(
            worker, slot, prefetch
        )
        source = prefetched_source = (fetched, slot)
        prefetched, accum, carried = params, zeros, no_steps  # carried: local steps in accum
        # A push in flight: the gradient of `outbox_steps` steps on parameters
        # from `outbox_source` (the latest fetch, when it spans several).
        outbox, outbox_steps, outbox_source = zeros, no_steps, source
        counts = (no_steps, no_steps, no_steps, no_steps)
        staleness = tf.TensorArray(tf.int64, size=0, dynamic_size=True)
        done = tf.constant(0, tf.int32)
        while done < num_steps or outbox_steps > 0:
            landed = no_steps
            if outbox_steps > 0:
                state, counts, staleness, landed = self.send(
                    outbox, outbox_steps, (worker, *outbox_source), state, counts, staleness
                )
            count = tf.minimum(self.block, num_steps - done)
            fetch_due = self.fetch_due(done, count, num_steps, prefetch)
            done += count
            ready = tf.constant(True)
            if fetch_due:
                ready = self.before_fetch(worker, fetches % 2)
            with tf.control_dependencies([ready] if self.background else [ready, landed]):
                packed, packed_source = self.read(worker, fetches % 2)
            if fetch_due:
                prefetched, prefetched_source = self.unpack_params(packed), packed_source
                fetches += 1
                if not self.background:
                    params, source = prefetched, prefetched_source
            accum, metric_values = self.local_steps(
                batches, done - count, count, params, accum, metric_values
            )
            carried += tf.cast(count, tf.int64)
            outbox_steps = no_steps
            if done % self.n_push == 0 or done == num_steps:
                outbox, outbox_steps, outbox_source = accum, carried, source
                accum, carried = zeros, no_steps
            if self.background and fetch_due:
                params, source = prefetched, prefetched_source
        saved = self.save(worker, state)
        saved += self.keep(carry_reads, num_steps, prefetch, prefetched, prefetched_source[0])
        steps = tf.cast(num_steps, tf.int64)
        steps = after_writes(steps, saved, self.metric_vars, metric_values, metrics_start)
        return self.counters(worker, steps, counts, fetches, started_prefetched, staleness)

    @_staleness.graph_code
    def save(self, worker, state):
        """The writes of per-worker state: the compressor's (error-feedback
        residuals, momenta) for this worker's next round, and the SSP clock.
        PerWorkerVariables get no automatic control dependencies: the writes
        are tied to the round's outputs (:func:`after_writes`)."""
        flat = zip(tf.nest.flatten(self.state_vars), tf.nest.flatten(state))
        return [v.assign(t) for v, t in flat] + [self.bound.stop(worker)]

    @_staleness.graph_code
    def keep(self, carry_reads, num_steps, prefetch, prefetched, version):
        """Keeps the last block's fetch for the next round, when the round
        carries fetches and its last block fetched (a round of whole fetch
        blocks). It misses the round's last push and whatever the server
        applies before the next round: that staleness is measured like any
        other. The writes come after ``carry_reads``, the round's reads of the
        same per-worker variables: they get no automatic control
        dependencies, and the generation a keep writes is known from the
        round's start, so without this the write could come first and the
        round take as prefetched parameters it never fetched."""
        if self.carry is None:
            return []
        with tf.control_dependencies(carry_reads):
            kept = tf.logical_and(num_steps > 0, num_steps % self.n_fetch == 0)
            kept = tf.logical_and(kept, prefetch)
            born = tf.where(kept, self.generation.read_value(), tf.constant(-1, tf.int64))
            return self.carry.keep(prefetched, version, born)

    @_staleness.graph_code
    def counters(self, worker, steps, counts, fetches, started_prefetched, staleness):
        """What a round returns to the chief."""
        sent, pushes, rejected, applied = counts
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
            "fetch_bytes": fetches * self.param_bytes + steps * 2 * self.nt_bytes,
        }


class WorkerCopy:
    """Values a worker keeps for its own next round, in per-worker variables.

    Downpour's round keeps the parameters its last block prefetched (tagged
    with the server version they were read at), EASGD's its replica and
    optimizer state (tagged with the steps since its last exchange). ``born``
    is the generation they were kept in (-1: none): they hold only while the
    server's weights are still that generation's
    (``DownpourRuntime.fit_generation``). A worker that is lost or restarted
    loses only this copy; its next round reads from the ``ps``.
    """

    def __init__(self, strategy, like, tag_dtype):
        def per_worker(value):
            return tf.Variable(value, trainable=False, per_worker_variable=True)

        with strategy.scope():
            self.values = [per_worker(tf.zeros(v.shape, v.dtype)) for v in like]
            self.tag = per_worker(tf.constant(-1, tag_dtype))
            self.born = per_worker(tf.constant(-1, tf.int64))

    @_staleness.graph_code
    def read(self):
        """``(values, tag, born)``."""
        return (
            [v.read_value() for v in self.values],
            self.tag.read_value(),
            self.born.read_value(),
        )

    @_staleness.graph_code
    def keep(self, values, tag, born):
        """The writes that hold ``values`` and ``tag``, kept in generation ``born``."""
        writes = [v.assign(t) for v, t in zip(self.values, values)]
        return writes + [self.tag.assign(tag), self.born.assign(born)]


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
    applier = _Applier(strategy, optimizer, trainable, loss_scale, server, version)
    compressor = strategy.compression
    if compressor is None:
        return _dense_push(applier, trainable, param_bytes), []
    with strategy.scope():
        state_vars = [
            tf.nest.map_structure(
                lambda t: tf.Variable(t, trainable=False, per_worker_variable=True),
                compressor.init(v.shape, v.dtype),
            )
            for v in trainable
        ]
    return _compressed_push(applier, compressor, trainable, version), state_vars


class _Applier:
    """A push's gradients applied on the ``ps`` tasks, if all of them are finite."""

    def __init__(self, strategy, optimizer, trainable, loss_scale, server, version):
        self.strategy, self.optimizer, self.trainable = strategy, optimizer, trainable
        self.loss_scale, self.server, self.version = loss_scale, server, version
        self.iterations = optimizer.iterations.value

    def checked(self, accepted, grads, steps, origin):
        """``(accepted, version before)``: applied if ``accepted``, else rejected."""
        return tf.cond(accepted, lambda: self.apply(grads, steps, origin), self.reject)

    def apply(self, grads, steps, origin):
        # Cross-replica context: each variable's update runs on the ps task
        # that owns it (extended.update colocates; a split one, piece by piece
        # on each piece's task). Keras counts 1; the push carries `steps`.
        with self.strategy.extended.per_shard_updates(self.optimizer, self.trainable):
            self.server.apply(self.optimizer, grads, *origin)
        with tf.control_dependencies([self.iterations.assign_add(steps - 1)]):
            self.loss_scale.after_accepted()
        # The version advances once the push is applied, on its ps: deciding
        # it on the worker took a crossing each way, the second after this
        # push's fetch had begun to cross (see pack). After the push's writes:
        # reads of every piece, which follow them.
        with tf.control_dependencies(tf.nest.flatten(_staleness.read_pieces(self.trainable))):
            before = self.version.assign_add(1) - 1
        return tf.constant(True), before

    def reject(self):
        self.loss_scale.after_rejected()
        return tf.constant(False), tf.constant(-1, tf.int64)

    @staticmethod
    def all_finite(tensors, devices):
        checks = []
        for t, device in zip(tensors, devices):
            with tf.device(device):
                checks.append(tf.reduce_all(tf.math.is_finite(t)))
        return tf.reduce_all(checks)


def _dense_push(applier, trainable, param_bytes):
    homes = [home(v) for v in trainable]

    def push(accum, state, steps, origin):
        # Checked on the worker, before it crosses: the crossing waits for no
        # answer from the ps (one that would queue behind a fetch in flight).
        accepted = applier.all_finite(accum, [None] * len(accum))
        grads = one_transfer_per_task(accum, homes, to_ps=True)
        _, before = applier.checked(accepted, grads, steps, origin)
        return accepted, before, state, tf.constant(param_bytes, tf.int64)

    return push


def _compressed_push(applier, compressor, trainable, version):
    homes = [home(v) for v in trainable]

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
        accepted, before = applier.checked(applier.all_finite(grads, homes), grads, steps, origin)
        if tf.nest.flatten(candidate):
            state = tf.cond(accepted, lambda: candidate, lambda: state)
        return accepted, before, state, tf.add_n([compressor.wire_bytes(w) for w in wires])

    return push


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
    weight's pieces did that in every block; copied by the stateful
    ``DeepCopy``, in some blocks. The round also sends the word before the
    values (:meth:`DownpourRound.read`).
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
