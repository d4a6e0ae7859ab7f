"""Shared machinery of the benchmarks (internal).

A benchmark module exposes ``run(quick: bool, seed: int) -> dict`` returning
``{"candidate": str, "peer": str, "figures": [...], "table": {...},
"notes": [...]}``. Each figure is a dict with at least ``case``, ``system``,
``metric``, ``unit`` and ``median`` (and ``repeats`` when measured more than
once). The runner adds machine information and versions and writes
``benchmarks/results/NAME.json``.
"""

import json
import os
import platform
import statistics
import sys
import time

from tfdist_ext.cluster._tf_config import TASK_ENV_DEFAULTS

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_in_process(module, cfg, timeout=900, repo=None, env=None):
    """Runs ``python -m MODULE 'json cfg'`` from the repository root, with a deadline.

    The module prints one line ``RESULT {json}``; returns that object. Each
    measured run is a fresh interpreter: a process connects to one
    TensorFlow cluster only, and logical devices are fixed per process.
    ``repo`` runs it from another checkout instead (e.g. to measure a
    baseline in the same interleaved run). ``env``: variables to set in the
    run's environment over this process's (a value ``None`` unsets one).
    """
    import subprocess

    run_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for name, value in (env or {}).items():
        if value is None:
            run_env.pop(name, None)
        else:
            run_env[name] = value

    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", module, json.dumps(cfg)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=run_env,
        stdin=subprocess.DEVNULL,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"benchmark run {cfg} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def interleaved(systems, repeats, warmup=1):
    """Measures several systems round-robin and returns their samples.

    ``systems`` maps a name to a zero-argument callable returning one sample
    (a number). Each round calls every system once, in a rotating order, so
    that drift in machine load hits all of them alike. ``warmup`` rounds are
    run first and discarded.

    Returns ``{name: [sample, ...]}``.
    """
    names = list(systems)
    for _ in range(warmup):
        for name in names:
            systems[name]()
    samples = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            samples[name].append(float(systems[name]()))
    return samples


def median(values):
    return float(statistics.median(values))


def figure(case, system, metric, unit, samples, **extra):
    """One figure: the median of ``samples`` with its unit and the raw samples."""
    samples = list(samples) if isinstance(samples, (list, tuple)) else [samples]
    out = {
        "case": case,
        "system": system,
        "metric": metric,
        "unit": unit,
        "median": median(samples),
        "repeats": samples,
    }
    out.update(extra)
    return out


def reached(runs):
    """The seconds each of ``runs`` took to its target, for those that reached it."""
    return [r["seconds_to_target"] for r in runs if r["seconds_to_target"] is not None]


def seconds_to_target_figure(case, system, runs, target, **extra):
    """Seconds to ``target`` accuracy over ``runs`` (NaN if none reached it)."""
    hit = reached(runs)
    return figure(
        case,
        system,
        "seconds_to_target",
        "s",
        hit or [float("nan")],
        target_accuracy=target,
        reached_in=f"{len(hit)}/{len(runs)}",
        **extra,
    )


def staleness_figure(case, system, staleness, **extra):
    """Pushes per staleness value over ``staleness``, one value per push."""
    histogram = [0] * (max(staleness) + 1)
    for value in staleness:
        histogram[value] += 1
    return {
        "case": case,
        "system": system,
        "metric": "staleness_histogram",
        "unit": "pushes per staleness value",
        "median": median(staleness),
        **extra,
        "histogram": histogram,
    }


def sharded_batches(tf, x, y, global_batch, seed):
    """A synchronous run's training input: ``(x, y)`` shuffled, in global batches,
    repeated, and split by the strategy's auto-sharding by data, as each worker
    of ``MultiWorkerMirroredStrategy`` reads it."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .batch(global_batch, drop_remainder=True)
        .repeat()
        .with_options(options)
    )


def machine_info():
    """Where a result was measured. ``vector_isa`` is the widest x86 SIMD set
    the cores report: the same CPU model name can hide machines whose compute
    differs by several times (with and without AVX-512)."""
    info = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
        # TensorFlow's environment switches that change its speed (run.py sets them).
        "tf_env": {name: os.environ.get(name) for name in TASK_ENV_DEFAULTS},
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["processor"] = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    isa = [f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags]
                    info["vector_isa"] = isa[0] if isa else None
                    break
        with open("/proc/meminfo") as f:
            info["memory_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def versions():
    out = {}
    for module in ("tensorflow", "keras", "numpy", "scipy", "sklearn"):
        try:
            out[module] = __import__(module).__version__
        except Exception:  # noqa: BLE001 - a missing optional module is fine
            pass
    return out


def format_table(table):
    columns = table["columns"]
    rows = [[_fmt(v) for v in row] for row in table["rows"]]
    widths = [
        max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(str(c))
        for i, c in enumerate(columns)
    ]
    line = "| " + " | ".join(str(c).ljust(w) for c, w in zip(columns, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join([line, sep, *body])


def _fmt(value):
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e5:
            return f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
        return f"{value:.3e}"
    return str(value)


def write_result(name, result, *, quick, seed, elapsed):
    os.makedirs(RESULTS_DIR, exist_ok=True)
    document = {
        "benchmark": name,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "seed": seed,
        "elapsed_seconds": round(elapsed, 1),
        "machine": machine_info(),
        "versions": versions(),
        "command": f"python -m benchmarks.run {name}" + (" --quick" if quick else ""),
        **result,
    }
    suffix = ".quick" if quick else ""
    path = os.path.join(RESULTS_DIR, f"{name}{suffix}.json")
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")
    return path


README = os.path.join(os.path.dirname(os.path.dirname(RESULTS_DIR)), "README.md")


def readme_markers(name):
    return (
        f"<!-- benchmark table: {name} (python -m benchmarks.run {name} --readme) -->",
        f"<!-- end of benchmark table: {name} -->",
    )


def update_readme(name, readme=README, results_dir=RESULTS_DIR):
    """Writes ``benchmarks/results/NAME.json``'s table into the README between
    its markers (:func:`readme_markers`); False when the README has none."""
    with open(os.path.join(results_dir, f"{name}.json")) as f:
        document = json.load(f)
    with open(readme) as f:
        text = f.read()
    begin, end = readme_markers(name)
    if begin not in text or end not in text:
        return False
    table = format_table(_readme_columns(name, document["table"]))
    source = (
        f"From `benchmarks/results/{name}.json` ({document['date'][:10]}, seed "
        f"{document['seed']}, {document['elapsed_seconds']:.0f} s), made by "
        f"`{document['command']}`."
    )
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(readme, "w") as f:
        f.write(f"{head}{begin}\n{table}\n\n{source}\n{end}{tail}")
    return True


def write_plot(name, results_dir=RESULTS_DIR):
    """Draws ``NAME.png`` beside ``benchmarks/results/NAME.json`` with the
    benchmark module's ``plot(document, path)``, so that a plot always shows
    the committed figures; the path, or None when the module has no ``plot``
    or matplotlib (the ``bench`` extra) is not installed."""
    import importlib
    import importlib.util

    module = importlib.import_module(f"benchmarks.{name}")
    if not hasattr(module, "plot") or importlib.util.find_spec("matplotlib") is None:
        return None
    with open(os.path.join(results_dir, f"{name}.json")) as f:
        document = json.load(f)
    return module.plot(document, os.path.join(results_dir, f"{name}.png"))


def _readme_columns(name, table):
    """``table`` cut to the benchmark's ``README_COLUMNS``, if its module has them."""
    import importlib
    import importlib.util

    module = f"benchmarks.{name}"
    if importlib.util.find_spec(module) is None:
        return table
    module = importlib.import_module(module)
    wanted = getattr(module, "README_COLUMNS", None)
    if not wanted:
        return table
    # README_LEAVES_OUT: values of the "row" column whose rows repeat others.
    left_out = getattr(module, "README_LEAVES_OUT", ())
    rows = [
        r
        for r in table["rows"]
        if "row" not in table["columns"] or r[table["columns"].index("row")] not in left_out
    ]
    keep = [table["columns"].index(c) for c in wanted]
    return {"columns": wanted, "rows": [[row[i] for i in keep] for row in rows]}
