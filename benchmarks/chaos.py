"""``chaos``: many faults over a long run, against the same run without them.

Each system trains the ``peers`` benchmark's digits MLP under Adagrad
(``_chaos_run.py``, a script written as a user writes it, with
``keras.callbacks.BackupAndRestore``) twice on the same seed: once
undisturbed, then under a seeded schedule of faults laid over the
undisturbed run's duration.

* ``downpour`` and ``easgd`` (``DownpourStrategy``,
  ``ElasticAveragingStrategy``): 2 workers and 1 ps of a ``LocalCluster``,
  the chief a process of its own.
  Every 20-40 s a random worker is killed (SIGKILL) and restarted; once, a
  worker is stopped (SIGSTOP) for longer than the strategy's ``deadline``
  and continued; once, the ps is killed. The chief's ``fit`` then raises
  ``ClusterError``; the ps is restarted and the chief script run again, as
  TensorFlow's retry loop does (tensorflow/tensorflow#42498), and resumes
  through BackupAndRestore.
* ``sync`` (``MultiWorkerMirroredStrategy``): 2 workers started by
  ``tfdist-ext launch --max-restarts 3``; worker 1 is killed twice, and the
  launcher relaunches the whole job, which resumes through BackupAndRestore.

Reported per system: faults injected and survived (the job still ended with
its result), epochs redone, the wall time lost against the undisturbed run
and the faults' own downtime (a killed worker: kill to restarted; a stall:
its length; the ps: kill to restarted; a sync worker: kill to its relaunched
process starting), held-out accuracy of both runs, hangs (a job or chief
past its deadline) and what was left behind: live processes of the run and
files in the job's own temporary directory (``TMPDIR`` of every process of
the job), which outlives the job until they are counted.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import _harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("downpour", "easgd", "sync")
# Epochs x steps sized for over 10 minutes of undisturbed training per
# async system on a 2-core machine (Downpour ~115 steps/s, EASGD ~210).
FULL = {
    "downpour": {"epochs": 240, "steps": 300, "deadline": 20.0},
    "easgd": {"epochs": 450, "steps": 300, "deadline": 20.0},
    "sync": {"epochs": 28, "steps": 200, "deadline": 20.0},
    "kill_every": (20.0, 40.0),
}
QUICK = {
    "downpour": {"epochs": 12, "steps": 100, "deadline": 6.0},
    "easgd": {"epochs": 12, "steps": 100, "deadline": 6.0},
    "sync": {"epochs": 8, "steps": 50, "deadline": 6.0},
    "kill_every": (8.0, 14.0),
}
STALL_MARGIN = 4.0  # a stall lasts the deadline plus this many seconds


def _run_marker(out):
    """Processes of a run carry its output directory in their command line."""
    return out.encode()


def _leftover_processes(marker, pids=()):
    """Live processes whose command line holds ``marker``, and live ``pids``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    found.add(int(entry))
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, 0)
            found.add(pid)
        except OSError:
            pass
    return sorted(found)


def _epochs(output):
    """(epochs begun, epochs ended) from a job's ``EPOCH_*`` lines."""
    lines = output.splitlines()
    return (
        sum(line.startswith("EPOCH_BEGIN") for line in lines),
        sum(line.startswith("EPOCH_END") for line in lines),
    )


def _result(output):
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def _last_error(stderr):
    """The exception the process ended with (a traceback's last line), else its last error line."""
    lines = stderr.splitlines()
    raised = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
    errors = raised or [line for line in lines if "Error" in line]
    return errors[-1][:300] if errors else stderr.strip()[-300:]


def _schedule(rng, span, kill_every, extra):
    """Times (s from the start) of the faults laid over ``span`` seconds:
    worker kills every ``kill_every`` seconds, plus ``extra`` kinds once
    each at a random point of their own slice of the run."""
    events, t = [], rng.uniform(*kill_every)
    while t < span:
        events.append((t, "kill"))
        t += rng.uniform(*kill_every)
    for i, kind in enumerate(extra):
        low, high = (0.2 + 0.5 * i / len(extra), 0.2 + 0.5 * (i + 1) / len(extra))
        events.append((span * rng.uniform(low, high), kind))
    return sorted(events)


class _Injector(threading.Thread):
    """Injects a schedule of faults into a ``LocalCluster``; records their downtime.

    A stalled worker is always continued, and a killed ps is restarted by
    :meth:`recover` (called when the chief has failed), under one lock with
    the kills and restarts here.
    """

    def __init__(self, cluster, events, rng, stall):
        super().__init__(daemon=True)
        self.cluster, self.events, self.rng, self.stall = cluster, events, rng, stall
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.injected = []  # (seconds from start, kind, downtime)
        self.ps_killed_at = None
        self.start_time = None

    def run(self):
        for at, kind in self.events:
            if self.done.wait(max(0.0, self.start_time + at - time.monotonic())):
                return
            getattr(self, f"_{kind}")()

    def _note(self, kind, began):
        self.injected.append((began - self.start_time, kind, time.monotonic() - began))

    def _kill(self):
        worker = self.rng.randrange(self.cluster.num_workers)
        with self.lock:
            began = time.monotonic()
            self.cluster.kill("worker", worker)
            self.cluster.restart("worker", worker)
            self._note("worker killed", began)

    def _stall(self):
        pid = self.cluster.pid("worker", self.rng.randrange(self.cluster.num_workers))
        began = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            self.done.wait(self.stall)
        finally:
            os.kill(pid, signal.SIGCONT)
        self._note("worker stalled", began)

    def _ps(self):
        with self.lock:
            self.ps_killed_at = time.monotonic()
            self.cluster.kill("ps", 0)

    def recover(self):
        """Restarts the ps if it was killed; True if it was."""
        with self.lock:
            if self.cluster.alive("ps", 0):
                return False
            self.cluster.restart("ps", 0)
            began, self.ps_killed_at = self.ps_killed_at or time.monotonic(), None
            self._note("ps killed", began)
            return True


def _spawn(argv, env):
    """Starts ``argv`` from the repository root in a session of its own; its ``_Reader``."""
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return _Reader(proc)


def _finish(reader, timeout):
    """Waits ``timeout`` seconds for the process, then kills its session; False if it hung."""
    if reader.wait(timeout):
        return True
    os.killpg(reader.proc.pid, signal.SIGKILL)
    reader.wait(30)
    return False


def _chief(cfg, env, timeout):
    """Runs the chief script once: ``(returncode or None if hung, stdout, stderr)``."""
    reader = _spawn([sys.executable, "-m", "benchmarks._chaos_run", json.dumps(cfg)], env)
    finished = _finish(reader, timeout)
    return reader.proc.returncode if finished else None, reader.stdout, reader.stderr


def _job_env(out):
    """The environment of a job's processes: their temporary files go to
    ``out/tmp``, so what they leave there is the run's alone."""
    os.makedirs(os.path.join(out, "tmp"), exist_ok=True)
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=os.path.join(out, "tmp"))


def _async_job(system, sizes, events, seed, out, timeout):
    """One ``downpour``/``easgd`` job on a fresh cluster, with ``events`` (or none)."""
    from tfdist_ext.cluster import LocalCluster

    cfg = dict(sizes[system], system=system, out=out, seed=seed)
    report = {"attempts": [], "hangs": 0}
    env = _job_env(out)
    tasks_env = {"TMPDIR": env["TMPDIR"]}
    with LocalCluster(num_workers=2, num_ps=1, isolated=False, verbose=0, env=tasks_env) as cluster:
        env["TF_CONFIG"] = cluster.tf_config("chief", 0)
        stall = sizes[system]["deadline"] + STALL_MARGIN
        injector = _Injector(cluster, events, random.Random(seed + 1), stall)
        start = injector.start_time = time.monotonic()
        injector.start()
        try:
            output = _attempts(cfg, env, timeout, start, injector, report)
        finally:
            injector.done.set()
            injector.join()
        pids = cluster.pids()
    report.update(_finished(output, time.monotonic() - start, injector.injected))
    report["cluster_pids"] = pids
    return report


def _attempts(cfg, env, timeout, start, injector, report):
    """Runs the chief until it ends with a result (restarting a killed ps); all its output."""
    output = ""
    while time.monotonic() - start < timeout:
        code, out, err = _chief(cfg, env, timeout - (time.monotonic() - start))
        output += out
        report["hangs"] += code is None
        if _result(out) is not None:
            return output
        report["attempts"].append(_last_error(err))
        if not injector.recover():
            time.sleep(1.0)  # a failure the schedule did not cause: try again
    return output


def _finished(output, wall, injected):
    begun, ended = _epochs(output)
    result = _result(output)
    return {
        "wall_seconds": wall,
        "accuracy": None if result is None else result["accuracy"],
        "completed": result is not None,
        "epochs_begun": begun,
        "epochs_redone": begun - ended if result is not None else None,
        "faults": [{"at": a, "kind": k, "downtime": d} for a, k, d in injected],
    }


def _sync_job(sizes, kills, seed, out, timeout):
    """One ``sync`` job under ``tfdist-ext launch``, worker 1 killed at ``kills`` seconds."""
    from tfdist_ext.cluster import free_port

    cfg = dict(sizes["sync"], system="sync", out=out, seed=seed)
    command = [sys.executable, "-m", "tfdist_ext.cli", "launch", "--hosts", "localhost,localhost"]
    command += ["--port", str(free_port()), "--max-restarts", str(len(kills) + 1), "--stop-timeout"]
    command += ["10", "--", sys.executable, "-m", "benchmarks._chaos_run", json.dumps(cfg)]
    start = time.monotonic()
    reader = _spawn(command, _job_env(out))
    injected = [_kill_sync_worker(out, start, at, reader, timeout) for at in kills]
    hung = not _finish(reader, timeout - (time.monotonic() - start))
    report = _finished(reader.stdout, time.monotonic() - start, [f for f in injected if f])
    failed = [line for line in reader.stderr.splitlines() if "exited with status" in line]
    report.update(hangs=int(hung), attempts=failed)
    return report


class _Reader:
    """Drains a process's output in threads, so it never blocks on a full pipe."""

    def __init__(self, proc):
        self.proc, self.stdout, self.stderr = proc, "", ""
        self.threads = [
            threading.Thread(target=self._drain, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._drain, args=(proc.stderr, "stderr"), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _drain(self, stream, name):
        for line in stream:
            setattr(self, name, getattr(self, name) + line)

    def wait(self, timeout):
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        for thread in self.threads:
            thread.join(10)
        return True


def _kill_sync_worker(out, start, at, reader, timeout):
    """Kills worker 1 ``at`` seconds after ``start`` (and after the job, since
    its last relaunch, has finished an epoch): ``(at, kind, downtime)`` once a new
    worker 1 has started, or None if the job ended (or ran out of time) first."""
    pid_file = os.path.join(out, "pid-worker-1")
    ended = _epochs(reader.stdout)[1]

    def over():
        return reader.proc.poll() is not None or time.monotonic() - start > timeout

    def ready():
        return os.path.exists(pid_file) and _epochs(reader.stdout)[1] > ended

    while True:
        while time.monotonic() < start + at or not ready():
            if over():
                return None
            time.sleep(0.2)
        with open(pid_file) as f:
            pid = int(f.read())
        os.remove(pid_file)
        began = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
            break
        except ProcessLookupError:
            continue  # that worker already ended (a relaunch): kill its successor
    while not os.path.exists(pid_file):
        if over():
            return None
        time.sleep(0.2)
    return (began - start, "worker killed", time.monotonic() - began)


def soak(system, sizes, seed, span=None, timeout=3600):
    """One job of ``system``: undisturbed if ``span`` is None, else under the
    fault schedule laid over ``span`` seconds. Its report, with ``leftover_processes``
    and ``leftover_files`` (what the job's processes left in their temporary directory)."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="tfdist-chaos-") as out:
        if system == "sync":
            kills = (
                [] if span is None else sorted(span * rng.uniform(a, a + 0.2) for a in (0.2, 0.55))
            )
            report = _sync_job(sizes, kills, seed, out, timeout)
            pids = ()
        else:
            events = (
                [] if span is None else _schedule(rng, span, sizes["kill_every"], ("stall", "ps"))
            )
            report = _async_job(system, sizes, events, seed, out, timeout)
            pids = report.pop("cluster_pids")
        time.sleep(1.0)  # a process stopped a moment ago is reaped
        report["leftover_processes"] = _leftover_processes(_run_marker(out), pids)
        report["leftover_files"] = sorted(os.listdir(os.path.join(out, "tmp")))
    return report


def _row(system, calm, chaos):
    faults = chaos["faults"]
    downtime = sum(f["downtime"] for f in faults)
    lost = chaos["wall_seconds"] - calm["wall_seconds"]
    return [
        system,
        len(faults),
        len(faults) if chaos["completed"] else 0,
        chaos["epochs_redone"],
        len(chaos["attempts"]),
        calm["wall_seconds"],
        chaos["wall_seconds"],
        lost,
        downtime,
        lost / downtime if downtime else None,
        calm["accuracy"],
        chaos["accuracy"],
        calm["hangs"] + chaos["hangs"],
        len(chaos["leftover_processes"]) + len(calm["leftover_processes"]),
        len(chaos["leftover_files"]) + len(calm["leftover_files"]),
    ]


def run(quick=False, seed=0):
    sizes = QUICK if quick else FULL
    figures, rows = [], []
    for system in SYSTEMS:
        calm = soak(system, sizes, seed)
        chaos = soak(system, sizes, seed, span=calm["wall_seconds"])
        for name, report in (("fault-free", calm), ("faults", chaos)):
            figures.append(
                _harness.figure(system, name, "wall", "s", [report["wall_seconds"]], report=report)
            )
        rows.append(_row(system, calm, chaos))
        print(json.dumps({"system": system, "row": rows[-1]}), flush=True)
    return {
        "candidate": "DownpourStrategy, ElasticAveragingStrategy, MultiWorkerMirroredStrategy under faults",
        "peer": "the same job on the same seed without faults",
        "figures": figures,
        "table": {
            "columns": [
                "system",
                "faults",
                "survived",
                "epochs redone",
                "restarts",
                "fault-free s",
                "with faults s",
                "time lost s",
                "fault downtime s",
                "lost / downtime",
                "fault-free acc",
                "with faults acc",
                "hangs",
                "leftover procs",
                "leftover files",
            ],
            "rows": rows,
        },
        "notes": [
            f"Digits MLP under Adagrad(0.05), batch 64 per worker step, seed {seed}; "
            f"sizes {json.dumps(sizes)}.",
            "Async: 2 workers + 1 ps (LocalCluster), a worker killed and restarted every "
            f"{sizes['kill_every'][0]:g}-{sizes['kill_every'][1]:g} s, one worker stopped for "
            f"deadline + {STALL_MARGIN:g} s, the ps killed once (chief script rerun, resumed by "
            "BackupAndRestore). Sync: tfdist-ext launch --max-restarts 3, worker 1 killed twice.",
            "Goal: every fault survived, accuracy within 1 point of fault-free, no hangs or "
            "leftovers, time lost <= 2x the faults' own downtime.",
        ],
    }
