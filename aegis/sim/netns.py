"""One network namespace per simulated node, so a node's network can be cut and restored.

Layout (iproute2, needs root): a bridge in the root namespace holds the hub address
``10.<net>.0.1`` (the rendezvous store and the test S3 server listen there); each node gets a
namespace ``aeg<id>-<k>`` with a veth pair whose inside end is ``eth0`` at ``10.<net>.0.<k+10>``
and whose outside end is a bridge port. Cutting a node = setting its bridge port down: packets
stop in both directions and open TCP connections stall (no reset), as in a real partition.

Every address is on the bridge this object creates; nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from dataclasses import dataclass

__all__ = ["NetnsNetwork", "netns_available"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_available() -> str | None:
    """None if namespaces, veth pairs and bridges can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"aegchk{uuid.uuid4().hex[:6]}"
    try:
        r = _ip("netns", "add", name, check=False)
        if r.returncode:
            return f"`ip netns add` failed: {r.stderr.strip()}"
        r = _ip("link", "add", f"{name}b", "type", "bridge", check=False)
        if r.returncode:
            return f"`ip link add type bridge` failed: {r.stderr.strip()}"
        return None
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    finally:
        with contextlib.suppress(Exception):
            _ip("link", "del", f"{name}b", check=False)
            _ip("netns", "del", name, check=False)


@dataclass
class NodeNet:
    ns: str
    addr: str
    port: str  # the bridge-side veth


def _nets_in_use() -> set[int]:
    """The second octets of every ``10.x.*`` IPv4 address on an interface of this namespace."""
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    nets = set()
    for word in out.split():
        if word.startswith("10.") and word.count(".") == 3:
            with contextlib.suppress(ValueError):
                nets.add(int(word.split(".")[1]))
    return nets


class NetnsNetwork:
    def __init__(self) -> None:
        self.id = uuid.uuid4().hex[:5]
        # a subnet no interface here has: a bridge left by a run that did not tear down (killed)
        # keeps its address, DOWN, and with its subnet taken again the host's replies to the
        # new nodes may leave through the old bridge's route (a route over a link that is down
        # is still used unless ignore_routes_with_linkdown is set): every node's connect to the
        # store timed out (a CI run of the in-process chaos slice)
        used = _nets_in_use()
        start = int(self.id, 16) % 150
        self.net = next((100 + (start + i) % 150 for i in range(150)
                         if 100 + (start + i) % 150 not in used), 100 + start)
        self.hub = f"10.{self.net}.0.1"
        self.bridge = f"aeg{self.id}br"
        self.nodes: dict[int, NodeNet] = {}

    def setup(self) -> NetnsNetwork:
        _ip("link", "add", self.bridge, "type", "bridge")
        # A fixed (locally administered) MAC: a bridge without one takes its ports' lowest, so
        # removing the namespace whose port held it (a node killed) changed the hub's MAC, and
        # every other namespace kept sending to the dead one until its ARP entry for the hub
        # expired: 33-47 s without the store (measured; the chaos campaign's 50 s stalls after
        # a node loss). A real cluster's store host keeps its MAC when a node dies.
        mac = "02:ae:" + ":".join(f"{self.id}0"[i:i + 2] for i in range(0, 6, 2)) + ":01"
        _ip("link", "set", "dev", self.bridge, "address", mac)
        _ip("addr", "add", f"{self.hub}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def add(self, k: int) -> NodeNet:
        """The namespace of node ``k`` (0 <= k < 200), created with its link up."""
        if not 0 <= k < 200:
            raise ValueError(f"node index {k} out of range")
        ns, port, inside = f"aeg{self.id}-{k}", f"aeg{self.id}p{k}", f"aeg{self.id}i{k}"
        addr = f"10.{self.net}.0.{k + 10}"
        _ip("netns", "add", ns)
        _ip("link", "add", port, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("-n", ns, "link", "set", inside, "name", "eth0")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", port, "master", self.bridge)
        _ip("link", "set", port, "up")
        self.nodes[k] = NodeNet(ns, addr, port)
        return self.nodes[k]

    def exec_prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[k].ns]

    def cut(self, k: int) -> None:
        _ip("link", "set", self.nodes[k].port, "down")

    def heal(self, k: int) -> None:
        _ip("link", "set", self.nodes[k].port, "up")

    def remove(self, k: int) -> None:
        node = self.nodes.pop(k, None)
        if node is not None:
            _ip("netns", "del", node.ns, check=False)  # takes the veth pair with it
            _ip("link", "del", node.port, check=False)

    def teardown(self) -> None:
        for k in list(self.nodes):
            self.remove(k)
        _ip("link", "del", self.bridge, check=False)
