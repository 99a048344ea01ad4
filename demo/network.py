"""Separate hosts on one machine: Linux network namespaces on a bridge.

Each host is a network namespace with one veth interface and its own address in
198.18.0.0/15 (the benchmarking range, RFC 2544: nothing leaves the machine); the
host side of every veth sits on one bridge, which also holds an address for the
machine itself (the demo process and the trace receiver run there). A process
started on a host sees only that host's interface: it binds and advertises its own
address, and reaches the others over the bridge. Links can be taken down and up, and
a host's processes killed, to try what a network or a node failure does.

Needs root (CAP_NET_ADMIN) and iproute2. Names are unique per `Network`, and `close()`
removes every namespace, veth and the bridge it made, also after a failed start.
A host has no DNS server: `ip netns exec` mounts `/etc/netns/<name>/` over `/etc`, where
each host gets a `hosts` file naming every host and a resolver that fails at once
(a lookup that waited for an unreachable DNS server would stall servers that
resolve their own address, as Python's http.server does).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from harness.poll import wait_until

# 198.18.0.0/15 = 198.18.0.0-198.19.255.255; one /24 per network.
_BASE = "198.18"
NETNS_ETC = Path("/etc/netns")
# A locally administered unicast MAC no interface here has (Network.partition).
_NOWHERE = "02:00:5e:00:de:ad"


class NetworkUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, or no iproute2)."""


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used on this machine (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    return None


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise NetworkUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One network namespace and its address."""

    name: str
    netns: str
    address: str
    veth: str  # the bridge side (root namespace): down = this host is cut off

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host's namespace (`ip netns exec` execs: same pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def pids(self) -> list[int]:
        proc = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return [int(p) for p in proc.stdout.split()]

    def link(self, up: bool) -> None:
        """Connect or cut this host's link to the bridge."""
        _ip("link", "set", self.veth, "up" if up else "down")

    def kill_all(self) -> list[int]:
        """Kill every process on this host (a node that dies); returns their pids."""
        killed = self.pids()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not self.pids(), f"every process on host {self.name} to be gone", 30)
        return killed


class Network:
    """A bridge and some hosts: `Network(["prefill", "decode", "obs"]).open()`."""

    def __init__(self, host_names: list[str]):
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkUnavailable(reason)
        tag = secrets.token_hex(2)
        self.subnet = f"{_BASE}.{int(tag, 16) % 250 + 1}"
        self.bridge = f"nxb{tag}"
        self.machine_address = f"{self.subnet}.1"
        self.hosts = {name: Host(name, f"nx{tag}-{name[:6]}", f"{self.subnet}.{i + 2}", f"nxv{tag}{i}")
                      for i, name in enumerate(host_names)}
        self._made: list[tuple[str, str]] = []  # ("netns"|"link", name) to remove, in order

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def open(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.machine_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                _ip("netns", "add", host.netns)
                self._made.append(("netns", host.netns))
                inner = f"{host.veth}i"
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", inner)
                self._made.append(("link", host.veth))
                _ip("link", "set", inner, "netns", host.netns)
                _ip("link", "set", host.veth, "master", self.bridge)
                _ip("link", "set", host.veth, "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", inner)
                _ip("-n", host.netns, "link", "set", inner, "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "route", "add", "default", "via", self.machine_address)
                self._write_etc(host)
        except BaseException:
            self.close()
            raise
        return self

    def partition(self, a: str, b: str, cut: bool = True) -> None:
        """Cut (or heal) the path between hosts `a` and `b` only: both keep their links to
        every other host. Each host's neighbour entry for the other points at a MAC no
        interface has, so their frames go nowhere and nothing reports an error (as when
        the network between two nodes fails); healing removes the entries."""
        for src, dst in ((self[a], self[b]), (self[b], self[a])):
            dev = f"{src.veth}i"
            if cut:
                _ip("-n", src.netns, "neigh", "replace", dst.address, "lladdr", _NOWHERE,
                    "dev", dev, "nud", "permanent")
            else:
                _ip("-n", src.netns, "neigh", "del", dst.address, "dev", dev)

    def _write_etc(self, host: Host) -> None:
        etc = NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        self._made.append(("etc", str(etc)))
        names = "".join(f"{h.address} {h.name}\n" for h in self.hosts.values())
        (etc / "hosts").write_text(f"127.0.0.1 localhost\n{self.machine_address} machine\n{names}")
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def close(self) -> None:
        """Kill what still runs on the hosts, then remove namespaces, veths and the bridge."""
        for host in self.hosts.values():
            if ("netns", host.netns) in self._made:
                with contextlib.suppress(Exception):
                    host.kill_all()
        for kind, name in reversed(self._made):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            elif kind == "etc":
                shutil.rmtree(name, ignore_errors=True)
            else:
                subprocess.run(["ip", "link", "del", name], capture_output=True)
        self._made.clear()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (should be none after close)."""
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        names = [h.netns for h in self.hosts.values()] + [h.veth for h in self.hosts.values()] + [self.bridge]
        left = [n for n in names if n in netns or f" {n}:" in links or f" {n}@" in links]
        return left + [str(NETNS_ETC / h.netns) for h in self.hosts.values()
                       if (NETNS_ETC / h.netns).exists()]

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
