"""Nodes with network stacks of their own: two network namespaces joined by a veth pair, each a 'node' with its own
address (10.77.N.1 and 10.77.N.2, a range used nowhere else, traffic only between the two), the machine's hostname
resolving to loopback inside each (as on many containers and cloud images). launch/multi_node.sh run as a user would,
without is_host or --local-addr, trains to the end as one process does; a rendezvous host that does not answer, an
address not of the node and a loopback one each end in one line within their timeout, with no process left behind.

Making namespaces needs root (CI runs as root); elsewhere these tests skip with the reason."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import netns
import pytest
from conftest import base_config, finetune_in_process, read_jsonl, write_config

from finetune.config.errors import UserError
from finetune.parallel import network


@pytest.fixture(scope="module")
def nodes():
    """Two namespaces joined by a veth pair (tests/netns.py), as (namespace, address, link)."""
    why = netns.refusal()
    if why:
        pytest.skip(why)
    try:
        with netns.nodes() as made:
            yield [(n.namespace, n.address, n.link) for n in made]
    except RuntimeError as err:
        pytest.skip(str(err))


@pytest.fixture(autouse=True)
def _nothing_left_running(request):
    """A test that fails with processes still running (a hung launch) leaves none to the next test."""
    yield
    if "nodes" in request.fixturenames:
        for namespace, _, _ in request.getfixturevalue("nodes"):
            netns.kill_left(namespace)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return netns.ip(*args)


def _launch(namespace: str, out_dir: Path, *options: str, config: Path | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    return netns.launch(netns.Node(namespace, "", ""), out_dir / f"{namespace}.log", *options, config=config, extra=extra)


def _left_in(namespace: str) -> list[str]:
    """The processes still running in the namespace."""
    return netns.left_in(netns.Node(namespace, "", ""))


def test_the_hostname_resolves_to_loopback_inside_each_node(nodes):
    for name, address, _ in nodes:
        resolved = subprocess.run(["ip", "netns", "exec", name, "getent", "hosts", socket.gethostname()], capture_output=True, text=True)
        assert resolved.stdout.split()[0] == "127.0.1.1", resolved


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_two_nodes_launched_as_written_train_to_the_end_as_one_process(tmp_path, tiny_model_dir, nodes, nnodes):
    """The issue's launch as written (no is_host, no --local-addr; a fixed size, and its elastic range 1:2 with
    last_call_timeout=5): each node takes its route's address, node 0 hosts the store, and the run ends with one
    process's losses at the same rows a step."""
    cfg = base_config(tiny_model_dir, tmp_path / "two", train={"max_steps": 12, "micro_batch_size": 1, "grad_accum": 2}, data={"eval": None},
                      checkpoint={"save_every": 5})
    config = write_config(tmp_path / "two.yaml", cfg)
    (host, host_address, _), (other, _, _) = nodes
    port = "29611" if nnodes == "2" else "29613"
    options = ["--nnodes", nnodes, "--rdzv-host", host_address, "--rdzv-port", port, "--rdzv-id", f"part-{port}", "--rdzv-conf", "last_call_timeout=5"]
    jobs = [_launch(name, tmp_path, *options, config=config) for name in (host, other)]
    codes = [job.wait(timeout=600) for job in jobs]
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in (host, other)}
    assert codes == [0, 0], logs
    assert f"--local_addr {host_address} --rdzv_conf last_call_timeout=5,is_host=1" in logs[host], logs[host]
    assert "--rdzv_conf last_call_timeout=5,is_host=0" in logs[other], logs[other]
    two = [r["loss"] for r in read_jsonl(tmp_path / "two" / "metrics.jsonl") if "loss" in r]
    # The global batch is the first start's: 1 x 2 x 2 processes, or 1 x 2 x 1 where the elastic job formed with node 0
    # alone and took node 1 in later (a resize event), keeping that batch.
    events = tmp_path / "two" / "events.jsonl"
    grew = events.exists() and any(e["event"] == "resize" for e in read_jsonl(events))
    one_cfg = base_config(tiny_model_dir, tmp_path / "one", train={"max_steps": 12, "micro_batch_size": 1, "grad_accum": 2 if grew else 4},
                          data={"eval": None})
    assert finetune_in_process("train", "--config", str(write_config(tmp_path / "one.yaml", one_cfg))).returncode == 0
    one = [r["loss"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    assert len(two) == 12 and two == pytest.approx(one, rel=1e-4, abs=1e-5)
    assert not _left_in(host) and not _left_in(other)


@pytest.mark.parametrize("case", ["unreachable rendezvous host", "an address not of the node", "a loopback address"])
def test_a_misaddressed_node_ends_in_one_line_within_its_timeout(tmp_path, nodes, case):
    (host, host_address, _), (other, other_address, link) = nodes
    prefix = host_address.rsplit(".", 1)[0]
    options, expected = {
        "unreachable rendezvous host": (["--rdzv-host", f"{prefix}.9", "--connect-timeout", "3"],
                                        f"launch/multi_node.sh: --rdzv-host: node {socket.gethostname()} ({other_address}) could not reach "
                                        f"the rendezvous at {prefix}.9:29612 within 3 s ("),
        "an address not of the node": (["--rdzv-host", host_address, "--local-addr", f"{prefix}.5"],
                                       f"launch/multi_node.sh: --local-addr: {prefix}.5 is not an address of node {socket.gethostname()} "
                                       f"(its addresses: 127.0.0.1, {other_address})"),
        "a loopback address": (["--rdzv-host", host_address, "--local-addr", "127.0.0.1"],
                               f"launch/multi_node.sh: --local-addr: node {socket.gethostname()} would take part from 127.0.0.1, a loopback "
                               f"address, while the rendezvous host {host_address} ({host_address}) is not"),
    }[case]
    job = _launch(other, tmp_path, "--nnodes", "2", "--rdzv-port", "29612", *options)
    assert job.wait(timeout=120) == 2
    lines = (tmp_path / f"{other}.log").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    assert not _left_in(other)


def test_a_worker_that_cannot_reach_rank_0s_store_says_so_within_its_timeout(monkeypatch):
    """What a worker sees where the launcher did not know rank 0's node's address (MASTER_ADDR on loopback, rank 0
    elsewhere): one line after FINETUNE_CONNECT_TIMEOUT seconds, instead of the 30 minutes of the collective timeout."""
    from conftest import free_port

    port = free_port()
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           network.TIMEOUT_VAR: "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(UserError, match=rf"rank 1 on node {socket.gethostname()}: rank 0's store at 127.0.0.1:{port} did not answer "
                                        r"within 1 s \(.*\)\. MASTER_ADDR is a loopback address on a job of several nodes"):
        network.check_store()
    with socket.socket() as listening:  # rank 0's store up: no wait
        listening.bind(("127.0.0.1", port))
        listening.listen()
        network.check_store()


def test_a_rendezvous_on_loopback_keeps_torchruns_choices_and_a_loopback_hostname_needs_an_address():
    """One machine (the rendezvous host written as 127.0.0.1 or localhost): torchrun chooses as it always has. A hostname
    that resolves to loopback here, in a job of several nodes, is refused in one line unless an address or interface is named."""
    assert network.choose("127.0.0.1", nodes=3) == network.choose("localhost", nodes=3) == network.Choice(None, None, None)
    name = socket.gethostname()
    if not network.loopback(network.resolve(name, "the hostname")):
        pytest.skip(f"{name} does not resolve to loopback on this machine")
    with pytest.raises(UserError, match=rf"--rdzv-host: {name} resolves to 127\.\d+\.\d+\.\d+ \(loopback\) on node {name}, so torchrun would give "
                                        "the other nodes an address they cannot reach"):
        network.choose(name, nodes=2)
    assert network.choose(name, nodes=1) == network.Choice(None, None, None)
    assert network.choose(name, iface="lo", nodes=2) == network.Choice("127.0.0.1", "lo", None)  # torchrun's hostname test picks the host


def test_a_node_cut_off_mid_run_stops_within_its_timeouts_and_the_run_resumes_once_the_link_is_back(tmp_path, tiny_model_dir, nodes):
    """A partition: node 1's link taken down mid-step, its processes alive. Both nodes' steps hang in the collective; each
    worker's watchdog (watchdog.min_seconds 15) ends it with code 4, and node 1's torchrun agent, left waiting on the
    rendezvous host's store, is stopped after --agent-grace (10 s): both nodes end with code 4 within twice their timeouts,
    nothing left running, the checkpoints before the cut intact. With the link back, the same command on both nodes resumes
    from the newest checkpoint and trains to the end."""
    import time

    cfg = base_config(tiny_model_dir, tmp_path / "run", train={"max_steps": 100000, "micro_batch_size": 1, "grad_accum": 2},
                      data={"eval": None}, checkpoint={"save_every": 10})
    cfg["watchdog"] = {"min_seconds": 15, "factor": 5}
    config = write_config(tmp_path / "run.yaml", cfg)
    (host, host_address, _), (other, _, link) = nodes
    options = ["--nnodes", "2", "--rdzv-host", host_address, "--rdzv-port", "29621", "--rdzv-id", "cut", "--agent-grace", "10"]
    jobs = [_launch(name, tmp_path, *options, config=config) for name in (host, other)]
    metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and len(read_jsonl(metrics)) > 25) and time.monotonic() < deadline and all(j.poll() is None for j in jobs):
        time.sleep(0.5)
    try:
        assert all(j.poll() is None for j in jobs), [(tmp_path / f"{n}.log").read_text()[-2000:] for n in (host, other)]
        cut = time.monotonic()
        assert _ip("-n", other, "link", "set", link, "down").returncode == 0
        ended = {}
        while len(ended) < 2 and time.monotonic() - cut < 200:
            ended.update({name: (job.returncode, time.monotonic() - cut) for name, job in zip((host, other), jobs)
                          if name not in ended and job.poll() is not None})
            time.sleep(0.2)
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        _ip("-n", other, "link", "set", link, "up")
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in (host, other)}
    assert ended[host][0] == ended[other][0] == 4 and ended[host][1] < 2 * 15 and ended[other][1] < 2 * (15 + 10), (ended, logs[other][-3000:])
    assert "over the 15 s limit" in logs[host] and "over the 15 s limit" in logs[other]  # a step's or a save's (the cut may come in one)
    assert "launch: a worker ended with code 4 and torchrun's agent had not ended 10 s later" in logs[other]
    assert not _left_in(host) and not _left_in(other)
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved and int(saved[-1].split("-")[1]) >= 20, saved
    last = int(saved[-1].split("-")[1])
    resumed = [_launch(name, tmp_path, *options, config=config, extra=["--set", f"train.max_steps={last + 4}"]) for name in (host, other)]
    assert [job.wait(timeout=300) for job in resumed] == [0, 0], [(tmp_path / f"{n}.log").read_text()[-2000:] for n in (host, other)]
    steps = [r["step"] for r in read_jsonl(metrics) if "loss" in r]
    assert steps[-4:] == [last + 1, last + 2, last + 3, last + 4], steps[-8:]
