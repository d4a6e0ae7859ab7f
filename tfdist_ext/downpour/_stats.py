"""Counters of a Downpour run (internal; reached as ``strategy.stats``)."""

import threading

import numpy as np


class DownpourStats:
    """What the replicas did: pushes, fetches, rejections, staleness, bytes.

    Updated on the chief as rounds finish; ``staleness`` holds one value per
    accepted push: the number of server updates between the pushing replica's
    last fetch and its push. ``steps_per_worker`` maps a worker's task index
    to the local steps it ran. ``lost_results`` counts rounds that finished
    (their pushes were applied) on a worker that died before the chief read
    their counters back; their steps are counted, their pushes and staleness
    are not. With ``max_staleness=s``, ``clock_leads[k]`` counts the fetches
    a worker started ``k`` fetch blocks ahead of the slowest live worker
    (``k <= s``; read at each epoch's end); ``None`` without.
    ``rounds`` counts the rounds whose counters were read, and
    ``prefetched_rounds`` those of them that started from the parameters
    their worker fetched during its previous round (no fetch crossed before
    their first step).

    Example:
      >>> strategy.stats.summary()   # doctest: +SKIP
      {'pushes': 400, 'staleness_mean': 0.97, 'staleness_max': 3, ...}
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.steps = 0
            self.pushes = 0
            self.fetches = 0
            self.rounds = 0
            self.prefetched_rounds = 0
            self.rejected_pushes = 0
            self.push_bytes = 0
            self.fetch_bytes = 0
            self.staleness = []
            self.steps_per_worker = {}
            self.lost_results = 0
            self.clock_leads = None

    def record(
        self,
        steps,
        pushes,
        fetches,
        rejected,
        push_bytes,
        fetch_bytes,
        staleness,
        worker=None,
        prefetched=0,
    ):
        with self._lock:
            if worker is not None:
                self.steps_per_worker[worker] = self.steps_per_worker.get(worker, 0) + int(steps)
            self.steps += int(steps)
            self.pushes += int(pushes)
            self.fetches += int(fetches)
            self.rounds += 1
            self.prefetched_rounds += int(prefetched)
            self.rejected_pushes += int(rejected)
            self.push_bytes += int(push_bytes)
            self.fetch_bytes += int(fetch_bytes)
            self.staleness.extend(int(s) for s in staleness)

    def record_lost_round(self, steps):
        """A round whose worker died after it finished, before its result was read."""
        with self._lock:
            self.steps += int(steps)
            self.lost_results += 1

    def summary(self, since=None):
        """Totals, and staleness mean/max, optionally since an earlier ``snapshot()``."""
        with self._lock:
            base = since or {
                "steps": 0,
                "pushes": 0,
                "fetches": 0,
                "rounds": 0,
                "prefetched_rounds": 0,
                "rejected_pushes": 0,
                "push_bytes": 0,
                "fetch_bytes": 0,
                "n_staleness": 0,
            }
            stale = np.asarray(self.staleness[base["n_staleness"] :], dtype=np.float64)
            steps = max(1, self.steps - base["steps"])
            return {
                "steps": self.steps - base["steps"],
                "pushes": self.pushes - base["pushes"],
                "fetches": self.fetches - base["fetches"],
                "rounds": self.rounds - base["rounds"],
                "prefetched_rounds": self.prefetched_rounds - base["prefetched_rounds"],
                "rejected_pushes": self.rejected_pushes - base["rejected_pushes"],
                "push_bytes_per_step": (self.push_bytes - base["push_bytes"]) / steps,
                "fetch_bytes_per_step": (self.fetch_bytes - base["fetch_bytes"]) / steps,
                "staleness_mean": float(stale.mean()) if stale.size else 0.0,
                "staleness_max": float(stale.max()) if stale.size else 0.0,
            }

    def snapshot(self):
        with self._lock:
            return {
                "steps": self.steps,
                "pushes": self.pushes,
                "fetches": self.fetches,
                "rounds": self.rounds,
                "prefetched_rounds": self.prefetched_rounds,
                "rejected_pushes": self.rejected_pushes,
                "push_bytes": self.push_bytes,
                "fetch_bytes": self.fetch_bytes,
                "n_staleness": len(self.staleness),
            }
