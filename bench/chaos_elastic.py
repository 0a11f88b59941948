"""make chaos-elastic: elastic jobs of three 'nodes' on loopback (a launch/multi_node.sh --nnodes 2:3 each: one
torchrun agent, one worker) while nodes are SIGKILLed at random moments (mid-save among them) and started again.
Every job must end with the numbers of one process that never lost anything: the same loss at every step (1e-5),
the same samples at every step (so each sample trained as often), and every step once in the final history.

    python bench/chaos_elastic.py [--minutes 6] [--strategies ddp,fsdp,zero3] [--seed 0]

The test (tests/test_elastic.py) runs fixed scenarios through the same Job.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import DATA, REPO, report

MICRO, ROWS = 1, 6  # 6 rows a step: 2 accumulated x 3 nodes, 3 x 2, or 6 in one process
PACE = 1.5  # seconds added to every step: time to kill and start nodes while the job runs
# A node that is gone leaves the rendezvous once its heartbeats are keep_alive_interval x keep_alive_max_attempt old
# (torch's default 5 s x 3); the survivors can't start their next round before. 1 s x 5 here: the agents are idle
# processes on one machine, and each loss costs 5 s of waiting instead of 15.
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"


def write_config(path: Path, model_dir: Path, out: Path, steps: int, accum: int, strategy: str, save_every: int = 0) -> Path:
    cfg = {"model": {"name_or_path": str(model_dir)}, "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(DATA / "train.jsonl"), "format": "alpaca", "max_seq_len": 128},
           "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": MICRO, "grad_accum": accum, "lr": 3e-3},
           "logging": {"report_to": [], "progress_bar": False, "plot": False, "sample_ids": True},
           "distributed": {"strategy": strategy}, "checkpoint": {"save_every": save_every}, "guard": {"enabled": False}}
    path.write_text(json.dumps(cfg))  # YAML reads JSON
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Gate:
    """FINETUNE_STEP_GATE's file: how many steps the job may have done (a step beyond waits), written whole. A test moves
    it on as it kills and starts nodes, so what happens between two steps does not depend on how fast the machine is."""

    def __init__(self, path: Path, steps: int):
        self.path = path
        self.set(steps)

    def set(self, steps: int) -> None:
        self.steps = steps
        part = self.path.with_suffix(".part")
        part.write_text(str(steps))
        part.replace(self.path)

    def env(self) -> dict:
        return {"FINETUNE_STEP_GATE": str(self.path)}


class Node:
    """One node's launch/multi_node.sh (its agent and worker die together, as a machine does). The job's pace: a gate
    (tests), else PACE seconds added to every step (the chaos bench's random moments)."""

    def __init__(self, index: int, port: int, config: Path, logs: Path, gate: Gate | None = None):
        cmd = ["bash", "launch/multi_node.sh", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-host", "127.0.0.1", "--rdzv-port", str(port),
               "--rdzv-id", f"elastic-{port}", "--rdzv-conf", RDZV_CONF, "--", "--config", str(config)]
        self.log = logs / f"node{index}.log"
        with self.log.open("a") as fh:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                            env={**os.environ, "PYTHON": sys.executable,
                                                 **(gate.env() if gate else {"FINETUNE_STEP_SECONDS": str(PACE)})})

    def kill(self) -> None:
        """Worker first: a worker outliving its agent would get SIGTERM (its parent's death) and save first."""
        import psutil

        tree = psutil.Process(self.process.pid)
        for process in [*reversed(tree.children(recursive=True)), tree]:
            process.send_signal(signal.SIGKILL)
        self.process.wait()


@dataclass
class Job:
    """Three nodes of one elastic run; node 0 hosts the rendezvous (it must outlive the others: docs/running.md)."""

    config: Path
    out: Path
    logs: Path
    port: int
    gate: Gate | None = None
    nodes: list[Node | None] = field(default_factory=list)  # None: a node lost, not yet started again
    kills: int = 0
    mid_save: int = 0

    def start(self) -> Job:
        """Node 0 first, the others once its agent listens on the rendezvous port. On loopback every node's agent
        may host the rendezvous (torchrun's choice: the first to bind the port): a node lost that hosted it would
        take the rendezvous with it, and the others would wait for it until their join timeout."""
        self.nodes = [Node(0, self.port, self.config, self.logs, self.gate)]
        self.until(lambda: listening(self.nodes[0].process.pid, self.port), "node 0's agent to host the rendezvous", seconds=120)
        self.nodes += [Node(i, self.port, self.config, self.logs, self.gate) for i in (1, 2)]
        return self

    def last_step(self) -> int:
        return max((r["step"] for r in read_jsonl(self.out / "metrics.jsonl") if "loss" in r), default=0)

    def resizes(self) -> list[str]:
        return [e["message"] for e in read_jsonl(self.out / "events.jsonl") if e["event"] == "resize"]

    def steps(self) -> int:
        return sum("loss" in r for r in read_jsonl(self.out / "metrics.jsonl"))

    def until(self, done, what: str, seconds: float = 300) -> None:
        began = time.monotonic()
        while not done():
            ended = {n.log.stem: n.process.poll() for n in self.nodes if n and n.process.poll() not in (None, 0)}
            if time.monotonic() - began > seconds or ended:
                why = f"exit codes {ended}" if ended else f"{seconds:.0f} s passed"
                logs = "\n".join(f"--- {n.log.name}\n{n.log.read_text()[-3000:]}" for n in self.nodes if n)
                raise AssertionError(f"waited for {what} ({why})\n{logs}")
            time.sleep(0.05)

    def lose_and_regain(self, index: int, mid_save: bool = False) -> None:
        """Node `index` killed (once a checkpoint's folder is being written, if mid_save), the job going on without it, the node
        started again and taken back. A job that ends meanwhile ends the episode."""
        seen = len(self.resizes())
        if mid_save:
            self.until(self.saving, "a save to begin")
        self.nodes[index].kill()
        self.nodes[index] = None
        self.kills, self.mid_save = self.kills + 1, self.mid_save + mid_save
        if self.gate:  # the others meet the loss in their next step's collectives, go on at two and train two steps there
            self.gate.set(self.gate.steps + 2)
        self.until(lambda: len(self.resizes()) > seen or self.finished(), "the job going on without the node")
        self.nodes[index] = Node(index, self.port, self.config, self.logs, self.gate)
        self.until(lambda: len(self.resizes()) > seen + 1 or self.finished(), "the job taking the node back")

    def saving(self) -> bool:
        """A checkpoint is being written (or the job ended). Gated, the job is moved on a step at a time until it writes
        one: a tiny model's save can be over before it is seen, so each step held at the gate is a new chance."""
        if any(self.out.glob("checkpoints/.step-*.tmp")) or self.finished():
            return True
        if self.gate and self.last_step() >= self.gate.steps:
            self.gate.set(self.gate.steps + 1)
        return False

    def finished(self) -> bool:
        return self.nodes[0].process.poll() is not None

    def wait(self) -> None:
        for node in self.nodes:
            code = node.process.wait(timeout=600)
            assert code == 0, f"{node.log.name} exited {code}:\n{node.log.read_text()[-3000:]}"


def compare(out: Path, reference: Path) -> dict:
    """The elastic run's final history against the reference's, step by step."""
    rows, expected = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r], [r for r in read_jsonl(reference / "metrics.jsonl") if "loss" in r]
    return {"steps": len(rows), "each step once": [r["step"] for r in rows] == list(range(1, len(expected) + 1)),
            "same samples": [r["samples"] for r in rows] == [r["samples"] for r in expected],
            "max loss diff": max((abs(a["loss"] - b["loss"]) for a, b in zip(rows, expected)), default=float("nan"))}


def listening(pid: int, port: int) -> bool:
    """Whether a process under `pid` listens on `port` (read from /proc: nothing connects to it)."""
    import psutil

    tree = {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid in tree for c in psutil.net_connections("tcp"))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference_run(work: Path, model_dir: Path, steps: int) -> Path:
    """One process, the same 6 rows a step, never interrupted."""
    out = work / "reference"
    config = write_config(work / "reference.json", model_dir, out, steps, ROWS // MICRO, "none")
    subprocess.run([sys.executable, "-m", "finetune", "train", "--config", str(config)], cwd=REPO, check=True, capture_output=True)
    return out


def chaos(work: Path, model_dir: Path, strategy: str, seconds: float, rng: random.Random) -> dict:
    """One job under random node losses for about `seconds`, then left to finish."""
    work.mkdir(parents=True, exist_ok=True)
    steps = max(12, int(seconds / (PACE + 0.5)))
    reference = reference_run(work, model_dir, steps)
    out = work / strategy
    job = Job(write_config(work / f"{strategy}.json", model_dir, out, steps, ROWS // (3 * MICRO), strategy, save_every=2), out, work, free_port())
    began = time.monotonic()
    job.start().until(lambda: job.steps() >= 2, "the first steps")
    while time.monotonic() - began < seconds and not job.finished():
        time.sleep(rng.uniform(0, 6))
        job.lose_and_regain(rng.choice([1, 2]), mid_save=rng.random() < 1 / 3)
    job.wait()
    return {"strategy": strategy, "kills": job.kills, "mid-save": job.mid_save, "resizes": len(job.resizes()), **compare(out, reference),
            "wall s": round(time.monotonic() - began)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=6, help="chaos time in all (shared by the strategies; each job then finishes)")
    p.add_argument("--strategies", default="ddp,fsdp,zero3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="/tmp/finetune-chaos-elastic")
    args = p.parse_args()
    import shutil

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from common import build_model

    build_model(work / "model", layers=2, hidden=128)
    rng, strategies = random.Random(args.seed), args.strategies.split(",")
    rows = [chaos(work / s, work / "model", s, args.minutes * 60 / len(strategies), rng) for s in strategies]
    keys = list(rows[0])
    report("chaos-elastic", [f"*make chaos-elastic, --seed {args.seed}, {args.minutes:g} minutes of chaos shared by {args.strategies}*", "",
                             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys),
                             *("| " + " | ".join(f"{v:.1e}" if isinstance(v, float) else str(v) for v in row.values()) + " |" for row in rows)])
    good = all(r["each step once"] and r["same samples"] and r["max loss diff"] < 1e-5 for r in rows)
    print("all runs ended with the uninterrupted run's numbers" if good else "A RUN DIFFERS from the uninterrupted run")
    sys.exit(0 if good else 1)


if __name__ == "__main__":
    main()
