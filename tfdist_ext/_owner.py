"""Who owns what a process leaves on disk, told so a later process can see it is gone (internal).

A pid alone does not say that: pids wrap (``pid_max`` is 32768 on many
machines, and every TensorFlow thread draws a number from the same range),
and ``/proc/<n>`` answers for a thread's id too. A token is
``<pid>.<start>``, the process's start time in clock ticks since boot
(field 22 of ``/proc/<pid>/stat``): it names a live process only while that
very process runs.
"""

import os


def token(pid=None):
    """The token of process ``pid`` (default: this one)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start(pid)}"


def alive(owner):
    """Whether the process ``owner`` (a token, or a bare pid) still runs.

    Without ``/proc`` (not Linux) nothing can be told, and every owner is
    taken to be alive: what it owns is kept.
    """
    if _start(os.getpid()) is None:
        return True
    pid, _, start = owner.partition(".")
    if not pid.isdigit() or (start and not start.isdigit()):
        return False
    current = _start(int(pid))
    return current is not None and (not start or current == int(start))


def _start(pid):
    """Start time of ``pid`` in clock ticks since boot; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])
