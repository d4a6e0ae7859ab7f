"""Small processes the cluster tests start beside a cluster or as its tasks:
``python -m tests.programs.stand_ins CASE [ARGS]``.

Some must start at once (``observe`` samples while the test holds its
GIL), so this module imports nothing heavy at the top; ``allocator``
imports TensorFlow itself.
"""

import collections
import json
import os
import socket
import sys
import time

from tests.programs import report


def fail():
    """A task that cannot start: exits at once with a message."""
    sys.exit("injected failure")


def sleep(seconds):
    """A task that never becomes ready: sleeps ``seconds``."""
    time.sleep(float(seconds))


def allocator():
    """Which CPU allocator TensorFlow gave a 4 MiB tensor (the pooling one keeps
    statistics, the default one has none), and ``TF_CPU_ALLOCATOR_USE_BFC``."""
    import tensorflow as tf

    tensor = tf.ones([1 << 20])  # 4 MiB, alive while the statistics are read
    try:
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        pool = peak >= tensor.shape.num_elements() * 4
    except ValueError:
        pool = False
    report(
        {
            "allocator": "pool" if pool else "default",
            "use_bfc": os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"),
        }
    )


def observe(pid, seconds):
    """Samples process ``pid``'s state (/proc) for ``seconds``: how often it was
    stopped (``T``) out of how many samples."""
    seen = collections.Counter()
    end = time.monotonic() + float(seconds)
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            seen[f.read().rsplit(")", 1)[1].split()[0]] += 1
        time.sleep(0.002)
    report({"stopped": seen["T"], "samples": sum(seen.values())})


def sink():
    """A task that takes N bytes on its port, acknowledges them with one byte,
    then sends N back."""
    port = int(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0].split(":")[1])
    server = socket.create_server(("0.0.0.0", port))
    conn, _ = server.accept()
    n = int(conn.recv(16).decode())
    got = 0
    while got < n:
        got += len(conn.recv(1 << 20))
    conn.sendall(b"k")
    conn.sendall(b"x" * n)
    conn.close()


CASES = {fn.__name__: fn for fn in (fail, sleep, allocator, observe, sink)}


def main(argv):
    """``CASE [ARGS]``: runs the case of that name with ARGS."""
    name, *args = argv
    CASES[name](*args)


if __name__ == "__main__":
    main(sys.argv[1:])
