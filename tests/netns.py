"""Network namespaces as pods on one node, for the tests that need a network beyond loopback.

Each pod gets a network namespace of its own with a veth into one bridge in the root namespace
(the node), an address on the bridge's /24, its own loopback, a UTS namespace whose hostname is
the pod's name, and an /etc/hosts (bind-mounted by `ip netns exec` from /etc/netns/NAME/hosts)
that maps Service and pod DNS names to pod addresses, as cluster DNS would. The root namespace
holds the bridge's own address: what a kubelet's probes come from. Not a test module.

Needs root and `ip` (iproute2); `available()` says whether this machine has them.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.231"  # RFC 2544's benchmarking range: never a real network's
NODE_IP = f"{SUBNET}.1"


def available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None:
        return False
    probe = f"cdk-probe-{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


@dataclass
class Pod:
    name: str  # its hostname, as a StatefulSet or Deployment pod's
    ip: str
    netns: str
    hosts: dict[str, str] = field(default_factory=dict)  # DNS name -> address
    host_link: str = ""  # its veth's end on the node's bridge

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside this pod: its network namespace, its hostname."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "--", "sh", "-c",
                f'hostname "{self.name}" && exec "$@"', "sh", *argv]  # fmt: skip


_NODES = itertools.count()


class Node:
    """A bridge and pods on it; `close()` removes every namespace, link and hosts file."""

    def __init__(self, tag: str | None = None) -> None:
        # unique per Node: a namespace whose last process has not exited yet keeps its veth
        self.tag = tag or f"{os.getpid() % 1000}{next(_NODES)}"
        self.bridge = f"cdkbr{self.tag}"[:15]
        self.pods: list[Pod] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{NODE_IP}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> Pod:
        i = len(self.pods) + 2
        pod = Pod(name, f"{SUBNET}.{i}", f"cdk{self.tag}-{i}")
        host, peer = f"cdkh{self.tag}{i}"[:15], f"cdkp{self.tag}{i}"[:15]
        _ip("netns", "add", pod.netns)
        pod.host_link = host
        self.pods.append(pod)
        _ip("link", "add", host, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", pod.netns)
        _ip("link", "set", host, "master", self.bridge, "up")
        _ip("addr", "add", f"{pod.ip}/24", "dev", peer, ns=pod.netns)
        _ip("link", "set", peer, "up", ns=pod.netns)
        _ip("link", "set", "lo", "up", ns=pod.netns)
        return pod

    def resolve(self, names: dict[str, str]) -> None:
        """Every pod's /etc/hosts: its own name, then `names` (DNS name -> address)."""
        for pod in self.pods:
            pod.hosts = {pod.name: pod.ip, **names}
            folder = Path("/etc/netns") / pod.netns
            folder.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", "::1 localhost"]
            lines += [f"{ip} {name}" for name, ip in pod.hosts.items()]
            (folder / "hosts").write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        for pod in self.pods:
            subprocess.run(["ip", "netns", "del", pod.netns], capture_output=True)
            subprocess.run(["ip", "link", "del", pod.host_link], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / pod.netns, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
