"""A node's address in a multi-node job, chosen and checked before anything waits on the network.

torchrun's c10d rendezvous decides which node hosts its store by comparing the endpoint with the local hostname's
addresses, and its agent publishes the hostname as the workers' MASTER_ADDR. Where the hostname resolves to loopback
(containers, cloud images whose /etc/hosts maps it to 127.0.0.1 or 127.0.1.1) or to another interface than the one the
nodes share (InfiniBand beside Ethernet), no node hosts the store, or a worker dials its own loopback: the job hangs
without a word. So launch/multi_node.sh asks this module first (`python -m finetune.parallel.network`):

- the address: --local-addr, else --iface's, else the source address the kernel routes to the rendezvous host from;
- the interface holding it, for gloo's and NCCL's sockets (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME);
- whether this node hosts the rendezvous store: its address is the rendezvous host's;
- then, on the other nodes, that the rendezvous host answers on its port, from that address, within the timeout.

A rendezvous host on loopback (one machine, several agents) keeps torchrun's own choices. Each failure is one line
naming the node, the address and the setting that fixes it, exit 2. Torch-free: it runs before any heavy import.
The workers make the last check themselves (check_store): rank 0's store answers within the same timeout.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import time
from dataclasses import dataclass

from finetune.config.errors import UserError

CONNECT_TIMEOUT = 120.0  # seconds: a node started a little after the others is still met
TIMEOUT_VAR = "FINETUNE_CONNECT_TIMEOUT"  # what launch/multi_node.sh --connect-timeout sets for the workers
SIOCGIFADDR = 0x8915


def interfaces() -> dict[str, str]:
    """This node's IPv4 addresses, each with the interface holding it (the first address of each interface)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def resolve(host: str, what: str) -> str:
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except socket.gaierror as err:
        raise UserError(f"{what}: {host} does not resolve to an IPv4 address ({err.strerror})") from None


def route_source(host_ip: str) -> str:
    """The address this node sends from to reach `host_ip` (the kernel's route; a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host_ip, 9))
        except OSError as err:
            raise UserError(f"--rdzv-host: no route from this node ({socket.gethostname()}) to {host_ip} ({err.strerror}); "
                            "give --local-addr or --iface") from None
        return s.getsockname()[0]


def loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


@dataclass
class Choice:
    address: str | None  # what torchrun publishes for this node (--local_addr); None: its own choice (a rendezvous on loopback)
    iface: str | None  # gloo's and NCCL's socket interface; None: theirs to choose (a rendezvous on loopback)
    hosts_store: bool | None  # torchrun's rendezvous is_host; None: torchrun decides (a rendezvous on loopback)

    def shell(self) -> str:
        """The choice as shell assignments, for launch/multi_node.sh to eval."""
        return "\n".join([f"LOCAL_ADDR={self.address or ''}", f"IFACE={self.iface or ''}",
                          f"IS_HOST={'' if self.hosts_store is None else int(self.hosts_store)}"])


def choose(rdzv_host: str, local_addr: str | None = None, iface: str | None = None, nodes: int = 2) -> Choice:
    """This node's address, interface and store role for a rendezvous at `rdzv_host` of a job of up to `nodes` nodes (see the
    module's docstring). A rendezvous host on loopback is this machine: written as a loopback address (or localhost), several
    agents on one machine, torchrun's own choices; a name that resolves to loopback here in a job of several nodes is a
    node whose hostname maps to loopback (its agent would publish an address no other node reaches): it needs --local-addr
    or --iface, said in one line."""
    node, host_ip = socket.gethostname(), resolve(rdzv_host, "--rdzv-host")
    own = interfaces()
    if iface is not None:
        held = [a for a, name in own.items() if name == iface]
        if not held:
            raise UserError(f"--iface: node {node} has no interface {iface} with an IPv4 address (its interfaces: "
                            f"{', '.join(f'{name} {a}' for a, name in own.items())})")
        if local_addr is not None and local_addr not in held:
            raise UserError(f"--local-addr: {local_addr} is not --iface {iface}'s address on node {node} ({held[0]})")
        local_addr = local_addr or held[0]
    if local_addr is not None and local_addr not in own:
        raise UserError(f"--local-addr: {local_addr} is not an address of node {node} (its addresses: {', '.join(own)})")
    on_loopback = loopback(host_ip)
    address = local_addr or (host_ip if host_ip in own else route_source(host_ip))
    if loopback(address) and not on_loopback:
        raise UserError(f"--local-addr: node {node} would take part from {address}, a loopback address, while the rendezvous host "
                        f"{rdzv_host} ({host_ip}) is not: the other nodes could never reach it; give this node's address on the "
                        "network the nodes share (--local-addr ADDR or --iface NAME)")
    if on_loopback and local_addr is None and iface is None:
        written_loopback = rdzv_host == "localhost" or _is_address(rdzv_host)
        if nodes > 1 and not written_loopback:
            raise UserError(f"--rdzv-host: {rdzv_host} resolves to {host_ip} (loopback) on node {node}, so torchrun would give the other "
                            "nodes an address they cannot reach; give this node's address on the network the nodes share (--local-addr "
                            "ADDR or --iface NAME, on every node), or write the rendezvous host as that address")
        return Choice(None, None, None)  # one machine: torchrun's own choices work
    # A rendezvous host on loopback here is this node (a hostname mapped to loopback): torchrun's own test of the hostname
    # makes it the host, and falls back to a client where another agent of this machine already is.
    return Choice(address, own.get(address), None if on_loopback else host_ip == address)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def reach(host: str, port: int, source: str | None, seconds: float) -> str | None:
    """Connect to host:port (from `source`) until it answers or `seconds` pass; None, or the last refusal's reason."""
    deadline, why = time.monotonic() + seconds, "no answer"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())),
                                          source_address=(source, 0) if source else None):
                return None
        except OSError as err:
            why = err.strerror or type(err).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.2)


def check_rendezvous(choice: Choice, rdzv_host: str, port: int, seconds: float) -> None:
    """A node that does not host the rendezvous store: the host answers on its port from this node's address."""
    if choice.hosts_store is not False:
        return
    why = reach(rdzv_host, port, choice.address, seconds)
    if why:
        raise UserError(f"--rdzv-host: node {socket.gethostname()} ({choice.address}) could not reach the rendezvous at {rdzv_host}:{port} "
                        f"within {seconds:g} s ({why}); start node 0's launch there, check --rdzv-host and --rdzv-port, give this node's "
                        "address on the network the nodes share (--local-addr or --iface), or wait longer (--connect-timeout)")


def check_store() -> None:
    """A worker other than rank 0, before its process group forms: rank 0's store (MASTER_ADDR:MASTER_PORT) answers
    within FINETUNE_CONNECT_TIMEOUT seconds. A worker given a loopback MASTER_ADDR on another node would otherwise wait
    for the collective timeout (30 minutes), silently."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or rank == 0 or "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return  # (the agent's own store: torchrun's rendezvous already reached it)
    host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    seconds = float(os.environ.get(TIMEOUT_VAR, CONNECT_TIMEOUT))
    why = reach(host, port, None, seconds)
    if why:
        several_nodes = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
        hint = (" MASTER_ADDR is a loopback address on a job of several nodes: the launcher did not know rank 0's node's address "
                "(launch/multi_node.sh --local-addr or --iface on each node)" if several_nodes and loopback(resolve(host, "MASTER_ADDR")) else "")
        raise UserError(f"rank {rank} on node {socket.gethostname()}: rank 0's store at {host}:{port} did not answer within {seconds:g} s "
                        f"({why}).{hint}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m finetune.parallel.network", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rdzv-host", required=True)
    p.add_argument("--rdzv-port", type=int, required=True)
    p.add_argument("--local-addr")
    p.add_argument("--iface")
    p.add_argument("--connect-timeout", type=float, default=CONNECT_TIMEOUT)
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX, as torchrun takes it")
    args = p.parse_args(argv)
    try:
        choice = choose(args.rdzv_host, args.local_addr, args.iface, int(args.nnodes.rpartition(":")[2] or 1))
        check_rendezvous(choice, args.rdzv_host, args.rdzv_port, args.connect_timeout)
    except UserError as err:
        print(f"launch/multi_node.sh: {err}", file=sys.stderr)
        return 2
    print(choice.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main())
