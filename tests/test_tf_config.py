"""TF_CONFIG parsing and the `tfdist-ext server` entry point's error handling."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tfdist_ext.cluster import TFConfigError
from tfdist_ext.cluster import parse_tf_config

GOOD = {
    "cluster": {
        "chief": ["127.0.0.1:2000"],
        "worker": ["127.0.0.1:2001", "127.0.0.1:2002"],
        "ps": ["127.0.0.1:2003"],
    },
    "task": {"type": "worker", "index": 1},
}


def test_parses_documented_form():
    cluster, task_type, index = parse_tf_config(json.dumps(GOOD), require_jobs=("ps", "worker"))
    assert cluster["worker"] == ["127.0.0.1:2001", "127.0.0.1:2002"]
    assert (task_type, index) == ("worker", 1)


def _bad(**changes):
    config = json.loads(json.dumps(GOOD))
    for path, value in changes.items():
        section, key = path.split("__")
        if value is None:
            del config[section][key]
        else:
            config[section][key] = value
    return json.dumps(config)


@pytest.mark.parametrize(
    "text, require, field",
    [
        ("{not json", (), "not valid JSON"),
        (_bad(cluster__trainer=["127.0.0.1:1"]), (), "cluster.trainer"),
        (_bad(task__index=2), (), "task.index"),
        (_bad(task__index="0"), (), "task.index"),
        (_bad(task__type="ps2"), (), "task.type"),
        (_bad(cluster__ps=None), ("ps", "worker"), "cluster.ps"),
        (_bad(cluster__worker=["localhost"]), (), "cluster.worker[0]"),
        (_bad(cluster__worker=[]), (), "cluster.worker"),
        (json.dumps({"task": {"type": "worker"}}), (), "cluster"),
        # Two tasks at one address: the second is named, with the first.
        (_bad(cluster__worker=["127.0.0.1:2001", "127.0.0.1:2001"]), (), "cluster.worker[1]"),
        (_bad(cluster__ps=["127.0.0.1:2000"]), (), "cluster.ps[0]: '127.0.0.1:2000' is also "),
        # A second chief.
        (_bad(cluster__chief=["127.0.0.1:2000", "127.0.0.1:2009"]), (), "cluster.chief: a cluster"),
    ],
)
def test_errors_name_the_field(text, require, field):
    with pytest.raises(TFConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_tf_config(text, require_jobs=require)


def test_missing_environment_variable(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(TFConfigError, match="TF_CONFIG is not set"):
        parse_tf_config()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text, args, field",
    [
        ("{bad", [], "not valid JSON"),
        (_bad(cluster__evaluatr=["127.0.0.1:1"]), [], "cluster.evaluatr"),
        (_bad(task__index=7), [], "task.index"),
        (_bad(cluster__ps=None), ["--strategy", "ps"], "cluster.ps"),
    ],
)
def test_server_cli_one_line_exit_2(text, args, field):
    env = dict(os.environ, TF_CONFIG=text)
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist_ext.server", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert field in lines[0]
    assert proc.stdout == ""


@pytest.mark.timeout(60)
def test_console_script_dispatches_to_server():
    env = dict(os.environ, TF_CONFIG="[]")
    proc = subprocess.run(
        [sys.executable, "-m", "tfdist_ext.cli", "server"],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2
    assert "TF_CONFIG must be a JSON object" in proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is not None,
    reason="with tf_keras installed (the bench extra) a task leaves TensorFlow's import alone",
)
def test_a_server_imports_tensorflow_without_keras_and_keras_still_imports_after():
    """A task starts faster without Keras (it never builds a Keras object); a
    ``TF_USE_LEGACY_KERAS`` the user set is left alone; ``import keras`` works."""
    code = (
        "import os, sys\n"
        "from tfdist_ext.server import _skip_tensorflows_keras_import as skip\n"
        "os.environ['TF_USE_LEGACY_KERAS'] = '0'\n"
        "skip()\n"
        "print(os.environ['TF_USE_LEGACY_KERAS'])\n"
        "del os.environ['TF_USE_LEGACY_KERAS']\n"
        "skip()\n"
        "print(os.environ['TF_USE_LEGACY_KERAS'])\n"
        "import tensorflow as tf\n"
        "print('keras' in sys.modules, 'sklearn' in sys.modules)\n"
        "import keras\n"
        "print(keras.optimizers.Adagrad(0.1).__class__.__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=100,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "1", "False", "False", "Adagrad"]
