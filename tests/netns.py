"""'Nodes' with network stacks of their own, for tests/test_network.py and bench/chaos_network.py: network namespaces
joined by a veth pair, each with an address of a range used nowhere else (10.77.0.1 and .2), traffic only
between them, the machine's hostname resolving to loopback inside each (as on many containers and cloud images), and
launch/multi_node.sh run inside one as a user would. Making namespaces needs root; `refusal` says why not where not."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Node:
    namespace: str
    address: str
    link: str  # its end of the veth pair: down cuts it off, its processes alive


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def refusal() -> str | None:
    """Why this machine cannot make the nodes (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2 (CI has both)"
    return None


@contextlib.contextmanager
def nodes(subnet: int = 77):
    """Two namespaces joined by a veth pair, with their addresses (10.SUBNET.0.1 and .2); /etc/netns/NAME/hosts (which
    `ip netns exec` shows as /etc/hosts inside) maps the hostname to 127.0.1.1. Removed at the end, with the files this
    made. Raises RuntimeError with ip's words where the machine refuses namespaces."""
    tag = uuid.uuid4().hex[:6]
    names, links = [f"ft{tag}a", f"ft{tag}b"], [f"v{tag}a", f"v{tag}b"]
    addresses = [f"10.{subnet}.0.1", f"10.{subnet}.0.2"]
    hosts = [Path("/etc/netns") / name for name in names]
    made = []
    try:
        for name in names:
            result = ip("netns", "add", name)
            if result.returncode != 0:
                raise RuntimeError(f"this machine refuses network namespaces: {result.stderr.strip()}")
            made.append(name)
        steps = [("link", "add", links[0], "type", "veth", "peer", "name", links[1])]
        for name, link, address in zip(names, links, addresses):
            steps += [("link", "set", link, "netns", name), ("-n", name, "addr", "add", f"{address}/24", "dev", link),
                      ("-n", name, "link", "set", link, "up"), ("-n", name, "link", "set", "lo", "up")]
        for step in steps:
            _must(ip(*step), step)
        for folder in hosts:
            folder.mkdir(parents=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        yield [Node(*node) for node in zip(names, addresses, links)]
    finally:
        for folder in hosts:
            shutil.rmtree(folder, ignore_errors=True)
        for name in made:
            ip("netns", "del", name)


def _must(result: subprocess.CompletedProcess, step) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")


def cut(node: Node, down: bool = True) -> None:
    """The node's link down (cut off, its processes alive) or up again."""
    _must(ip("-n", node.namespace, "link", "set", node.link, "down" if down else "up"), ("link", node.link))


def launch(node: Node, log: Path, *options: str, config: Path | None = None, extra: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    """launch/multi_node.sh inside the node, one process, its output in `log`."""
    args = ["--", "--config", str(config) if config else "configs/demo.yaml", *extra]
    return subprocess.Popen(["ip", "netns", "exec", node.namespace, "bash", "launch/multi_node.sh", "--nproc-per-node", "1", *options, *args],
                            cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def left_in(node: Node) -> list[str]:
    """The processes still running in the node."""
    return ip("netns", "pids", node.namespace).stdout.split()


def kill_left(namespace: str) -> None:
    """SIGKILL whatever still runs in the namespace: a failed test's processes would otherwise fail the next ones."""
    for pid in ip("netns", "pids", namespace).stdout.split():
        subprocess.run(["kill", "-9", pid], capture_output=True)
