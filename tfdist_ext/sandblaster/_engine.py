"""One distributed pass over the data: slices, backup copies, exactly-once commits (internal).

A *pass* evaluates the objective and its gradient at the point the model's
parameters hold. The data is split into many more slices than workers; one
coordinator thread per worker hands it the next pending slice as soon as it
is free, so faster workers do more slices. When no slice is pending, an idle
worker takes a *backup copy* of the slice that has been running longest
(at most ``max_copies`` copies of a slice run at once) and whichever copy
finishes first counts.

Exactly-once: a worker computes its slice's weighted gradient into its own
staging buffer on the ``ps`` tasks and returns only scalars (the slice's
loss share and metric sums). Under a lock the coordinator then admits the
first finished copy of each slice, and asks the ``ps`` tasks to add that
worker's staging buffer to the accumulator (an op that runs on the ``ps``
tasks alone, so the worker may even have died meanwhile). Copies that
finish later, or belong to a finished pass, are dropped. A worker whose RPC
fails as unavailable is taken out of the rotation and its unfinished slices
go back to the queue: the pass only slows down.

Each worker keeps the data (sent once) and a local copy of the parameters,
refreshed once per pass, in variables on its own task.
"""

import collections
import threading
import time

import numpy as np
import tensorflow as tf

from tfdist_ext import _integration
from tfdist_ext.cluster._local import ClusterError
from tfdist_ext.cluster._local import ClusterTimeoutError

# Errors that mean "this task is gone", not "this computation is wrong".
_LOST = (
    tf.errors.UnavailableError,
    tf.errors.CancelledError,
    tf.errors.AbortedError,
    tf.errors.DeadlineExceededError,
)


class PassReport(
    collections.namedtuple(
        "PassReport",
        "loss aux seconds slices copies backups wasted lost_workers "
        "slices_per_worker received_bytes",
    )
):
    """What one pass did.

    Fields: ``loss`` (sum of the slices' loss shares), ``aux`` (summed metric
    state), ``seconds``, ``slices``, ``copies`` (slice computations started,
    including backups and redone ones), ``backups`` (backup copies started),
    ``wasted`` (copies finished after another copy had counted), ``lost_workers``
    (workers found lost while the pass ran, or since the previous pass ended:
    a backup copy still running when its pass ended can fail later),
    ``slices_per_worker`` (counted slices by
    worker), ``received_bytes`` (bytes the coordinator received from workers).
    """


class _Pass:
    def __init__(self, number, slices):
        self.number = number
        self.slices = slices
        self.pending = collections.deque(range(len(slices)))
        self.running = collections.defaultdict(set)  # slice -> workers computing it
        self.started = {}  # slice -> first start time
        self.claimed = set()  # slices whose commit is admitted
        self.results = {}  # slice -> outputs of the counted copy
        self.by_worker = collections.Counter()
        self.copies = self.backups = self.wasted = 0
        self.received = 0
        self.lost = []
        self.error = None
        self.progress = time.monotonic()
        self.finished = False


class Evaluator:
    """Per-worker data, parameter copies and slice function; the pass scheduler.

    Args:
      strategy: the ``SandblasterStrategy`` (cluster, deadline, knobs).
      parameters: list of parameter groups, each the list of its ``ps``
        pieces in axis-0 order (one piece unless the parameter is sharded).
      vectors: the ``ShardedVectors`` (accumulator and staging buffers).
      loss_fn: ``loss_fn(params, batch) -> (mean_loss, aux)``: ``params``
        holds one tensor per parameter group, ``batch`` the slice of the data
        (same structure as ``data``), ``aux`` a list of additive tensors
        (metric state) summed over slices.
      data: a nest of arrays with a common first dimension.
    """

    def __init__(self, strategy, parameters, vectors, loss_fn, data):
        self.strategy = strategy
        self.parameters = parameters
        self.vectors = vectors
        self.loss_fn = loss_fn
        flat = [np.asarray(a) for a in tf.nest.flatten(data)]
        self.num_examples = len(flat[0])
        self.devices = [
            f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(strategy.num_workers)
        ]
        self._structure = data
        self._workers = self._build_workers(flat, strategy.deadline)
        self.slices = _split(self.num_examples, strategy.slices_per_worker * len(self.devices))
        self._cv = threading.Condition()
        self._pass = None
        self._passes = 0
        self._dead = set()
        self._unreported = []  # workers lost between passes: named by the next report
        self._fresh = [None] * len(self.devices)
        self._threads = []
        self._closed = False

    # ------------------------------------------------------------ building
    def _build_workers(self, flat, deadline):
        """Sends the data to every worker at once, each send with a deadline."""
        built = [None] * len(self.devices)
        errors = []

        def build(w):
            try:
                built[w] = self._build_worker(w, flat)
            except Exception as e:  # reported below, in the caller's thread
                errors.append(e)

        threads = [
            threading.Thread(target=build, args=(w,), daemon=True, name=f"sandblaster-upload-{w}")
            for w in range(len(self.devices))
        ]
        for thread in threads:
            thread.start()
        end = time.monotonic() + deadline
        for w, thread in enumerate(threads):
            thread.join(timeout=max(0.0, end - time.monotonic()))
            if thread.is_alive():
                raise ClusterTimeoutError(
                    f"Sandblaster: sending the training data to worker {w} did not finish "
                    f"within {deadline:.0f} s"
                )
        if errors:
            raise errors[0]
        return built

    def _build_worker(self, w, flat):
        blocks = [piece for group in self.parameters for piece in group]
        with tf.device(self.devices[w]):
            data = [tf.Variable(a, trainable=False, name=f"sandblaster_data{w}") for a in flat]
            local = [
                tf.Variable(
                    tf.zeros(b.shape, b.dtype), trainable=False, name=f"sandblaster_param{w}"
                )
                for b in blocks
            ]
        stage = self.vectors.stage[w]
        total = float(self.num_examples)
        sizes = [len(g) for g in self.parameters]
        structure = self._structure

        @tf.function
        def refresh():
            for copy, block in zip(local, blocks):
                copy.assign(block)

        @tf.function(input_signature=[tf.TensorSpec([], tf.int64)] * 2)
        def compute(start, size):
            batch = tf.nest.pack_sequence_as(structure, [v[start : start + size] for v in data])
            share = tf.cast(size, tf.float64) / total
            with tf.GradientTape() as tape:
                pieces = [v.read_value() for v in local]
                tape.watch(pieces)
                params, i = [], 0
                for n in sizes:
                    group = pieces[i : i + n]
                    params.append(group[0] if n == 1 else tf.concat(group, axis=0))
                    i += n
                loss, aux = self.loss_fn(params, batch)
                weighted = loss * tf.cast(share, loss.dtype)
            grads = tape.gradient(weighted, pieces)
            for buffer, g, piece in zip(stage, grads, pieces):
                buffer.assign(tf.zeros_like(piece) if g is None else tf.convert_to_tensor(g))
            return [tf.cast(loss, tf.float64) * share] + [tf.convert_to_tensor(a) for a in aux]

        return refresh, compute

    # ------------------------------------------------------------ a pass
    def run_pass(self):
        """Evaluates at the current parameters; returns a :class:`PassReport`.

        On return the ``ps`` accumulator holds the full gradient.

        Raises:
          ClusterError: every worker was lost.
          ClusterTimeoutError: no slice finished for ``deadline`` seconds.
        """
        self._start_threads()
        self.vectors.zero_accumulator()
        deadline = self.strategy.deadline
        t0 = time.perf_counter()
        with self._cv:
            p = self._begin_pass()
            try:
                while len(p.results) < len(p.slices):
                    if p.error is not None:
                        raise p.error
                    if len(self._dead) == len(self.devices):
                        raise ClusterError(
                            f"Sandblaster: every worker was lost (pass {p.number}, "
                            f"{len(p.results)} of {len(p.slices)} slices done)"
                        )
                    waited = time.monotonic() - p.progress
                    if waited > deadline:
                        running = {s: sorted(ws) for s, ws in p.running.items() if ws}
                        raise ClusterTimeoutError(
                            f"Sandblaster: no slice finished for {deadline:.0f} s in pass "
                            f"{p.number} ({len(p.results)} of {len(p.slices)} done; running "
                            f"slice: workers {running}); a worker is stuck and backup "
                            "tasks are off or exhausted"
                        )
                    self._cv.wait(timeout=min(1.0, deadline - waited + 0.01))
            finally:
                p.finished = True
                self._cv.notify_all()
        outputs = [p.results[s] for s in range(len(p.slices))]
        loss = float(sum(o[0] for o in outputs))
        aux = [sum(o[k] for o in outputs) for k in range(1, len(outputs[0]))]
        report = PassReport(
            loss=loss,
            aux=aux,
            seconds=time.perf_counter() - t0,
            slices=len(p.slices),
            copies=p.copies,
            backups=p.backups,
            wasted=p.wasted,
            lost_workers=list(p.lost),
            slices_per_worker=[p.by_worker[w] for w in range(len(self.devices))],
            received_bytes=p.received,
        )
        self.strategy.passes.append(report)
        return report

    def _begin_pass(self):
        """A new current pass, which reports the losses found since the last one (under the lock)."""
        self._passes += 1
        p = self._pass = _Pass(self._passes, self.slices)
        p.lost, self._unreported = self._unreported, []
        self._cv.notify_all()
        return p

    def _next_task(self, w):
        """The slice worker ``w`` should compute next (called under the lock)."""
        p = self._pass
        if p is None or p.finished:
            return None
        if p.pending:
            s = p.pending.popleft()
        elif self.strategy.backup_tasks:
            candidates = [
                s
                for s, ws in p.running.items()
                if ws and s not in p.claimed and w not in ws and len(ws) < self.strategy.max_copies
            ]
            if not candidates:
                return None
            s = min(candidates, key=p.started.__getitem__)
            p.backups += 1
        else:
            return None
        p.running[s].add(w)
        p.started.setdefault(s, time.monotonic())
        p.copies += 1
        return p, s

    def _worker_loop(self, w):
        executor = _integration.executor_lib.new_executor(enable_async=False)
        try:
            self._serve(w, executor)
        finally:
            # An executor re-raises a lost worker's error when it is deleted
            # ("Exception ignored in Executor.__del__"); it was handled here.
            executor.clear_error()

    def _serve(self, w, executor):
        with _integration.eager_context.executor_scope(executor), tf.device(self.devices[w]):
            while True:
                with self._cv:
                    task = None
                    while task is None:
                        if self._closed:
                            return
                        task = self._next_task(w)
                        if task is None:
                            self._cv.wait()
                p, s = task
                start, size = p.slices[s]
                try:
                    refresh, compute = self._workers[w]
                    if self._fresh[w] != p.number:
                        refresh()
                        self._fresh[w] = p.number
                    out = [
                        t.numpy()
                        for t in compute(tf.constant(start, tf.int64), tf.constant(size, tf.int64))
                    ]
                except _LOST as e:
                    self._lose(w, p, s, e)
                    return
                except Exception as e:  # the user's computation failed: stop the pass
                    with self._cv:
                        p.running[s].discard(w)
                        if p.error is None:
                            p.error = e
                        self._cv.notify_all()
                    continue
                self._finish(w, p, s, out)

    def _finish(self, w, p, s, out):
        with self._cv:
            p.running[s].discard(w)
            p.received += sum(o.nbytes for o in out)
            admitted = not p.finished and s not in p.claimed
            if admitted:
                p.claimed.add(s)
            else:
                p.wasted += 1
        if not admitted:
            return
        try:
            self.vectors.commit(w)
        except Exception as e:  # a ps task failed: nothing can be trusted
            with self._cv:
                if p.error is None:
                    p.error = ClusterError(
                        f"Sandblaster: committing slice {s} to the parameter servers failed: {e}"
                    )
                self._cv.notify_all()
            return
        with self._cv:
            p.results[s] = out
            p.by_worker[w] += 1
            p.progress = time.monotonic()
            self._cv.notify_all()

    def _lose(self, w, p, s, error):
        with self._cv:
            self._dead.add(w)
            p.running[s].discard(w)
            # Reported by the pass running now; a copy that outlived its
            # pass fails after that pass's report, so the next one names it.
            current = self._pass
            if current is not None and not current.finished:
                current.lost.append(w)
            else:
                self._unreported.append(w)
            if not p.finished and s not in p.claimed and not p.running[s]:
                p.pending.appendleft(s)
            self._cv.notify_all()
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        tf.get_logger().warning(
            "Sandblaster: worker %d lost computing slice %d of pass %d (%s); its slices go "
            "to the others",
            w,
            s,
            p.number,
            message,
        )

    def _start_threads(self):
        if self._threads:
            return
        for w in range(len(self.devices)):
            thread = threading.Thread(
                target=self._worker_loop, args=(w,), name=f"sandblaster-worker-{w}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    @property
    def lost_workers(self):
        """Workers taken out of the rotation because they became unreachable."""
        return sorted(self._dead)

    def close(self):
        """Stops the worker threads (a thread stuck in an RPC is left to die with the process)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=0.1)


def _split(n, parts):
    """``parts`` contiguous (start, size) slices covering ``range(n)``, sizes differing by <= 1."""
    parts = max(1, min(parts, n))
    bounds = np.linspace(0, n, parts + 1).round().astype(int)
    return [(int(a), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:])]
