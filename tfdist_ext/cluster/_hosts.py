"""Hosts for a rehearsal: named network namespaces on one switch (internal).

``ip netns exec tfx-<address> COMMAND`` runs COMMAND on "host" <address>,
as ``ssh <host> COMMAND`` would on a real machine. The namespaces, their
links and the switch exist while :class:`Hosts` is open; each rehearsal
records its owner (:mod:`tfdist_ext._owner`), and namespaces left by an
owner that was killed are removed by the next rehearsal.
"""

import os
import subprocess

from tfdist_ext import _owner
from tfdist_ext.cluster import _netns

PREFIX = "tfx-"
STATE_DIR = "/run/tfdist-ext"


class Hosts:
    """``count`` hosts ``10.214.<k>.10``, ``.11``, ...: ``with Hosts(3) as h: h.addresses``."""

    def __init__(self, count, bandwidth=None):
        if not 1 <= count <= 10:
            raise ValueError(f"a rehearsal has 1 to 10 hosts, got {count}")
        missing = _netns.missing_requirements()
        if missing:
            raise RuntimeError("a rehearsal needs " + "; ".join(missing))
        self.count = count
        self.bandwidth = _netns.parse_bandwidth(bandwidth) if bandwidth else None
        self.addresses, self.subnet = [], None

    def namespace(self, address):
        return PREFIX + address

    def __enter__(self):
        _remove_orphans()
        os.makedirs(STATE_DIR, exist_ok=True)
        self.subnet = _free_subnet()
        with open(self._state_file(), "w") as f:
            f.write(_owner.token())
        try:
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        _remove(self.subnet)

    def _state_file(self):
        return os.path.join(STATE_DIR, f"rehearsal-{self.subnet}")

    def _create(self):
        switch = f"{PREFIX}switch-{self.subnet}"
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i in range(self.count):
            address = f"10.214.{self.subnet}.{10 + i}"
            name = self.namespace(address)
            _ip("netns", "add", name)
            _ip("-n", switch, "link", "add", f"h{i}", "type", "veth", "peer", "eth0", "netns", name)
            _ip("-n", switch, "link", "set", f"h{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")
            if self.bandwidth:
                for ns, dev in ((name, "eth0"), (switch, f"h{i}")):
                    rule = _netns._rate_limit(dev, self.bandwidth).split()
                    _run(["tc", "-n", ns, *rule])
            self.addresses.append(address)


def _ip(*args):
    _run(["ip", *args])


def _run(argv):
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=_netns.COMMAND_TIMEOUT, check=False
    )
    if result.returncode:
        raise _netns.NetworkError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


def _names():
    try:
        return os.listdir("/run/netns")
    except FileNotFoundError:
        return []


def _free_subnet():
    used = {int(n.split(".")[2]) for n in _names() if n.startswith(PREFIX + "10.214.")}
    used |= {int(n.rsplit("-", 1)[1]) for n in _names() if n.startswith(PREFIX + "switch-")}
    for k in range(1, 255):
        if k not in used:
            return k
    raise _netns.NetworkError("no free 10.214.k.0/24 subnet for a rehearsal")


def _remove(subnet):
    for name in _names():
        if name == f"{PREFIX}switch-{subnet}" or name.startswith(f"{PREFIX}10.214.{subnet}."):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    try:
        os.remove(os.path.join(STATE_DIR, f"rehearsal-{subnet}"))
    except FileNotFoundError:
        pass


def _remove_orphans():
    if not os.path.isdir(STATE_DIR):
        return
    for entry in os.listdir(STATE_DIR):
        if not entry.startswith("rehearsal-"):
            continue
        with open(os.path.join(STATE_DIR, entry)) as f:
            owner = f.read().strip()
        if owner and not _owner.alive(owner):
            _remove(int(entry.split("-")[1]))
