"""make chaos-network: the partition matrix over real interfaces. Two network namespaces joined by a veth pair, each a
'node' (its own address, tests/netns.py) running launch/multi_node.sh as a user would; mid-run node 1's link goes down,
its processes alive. Each case says when each node noticed and how it ended, what was left running, the newest
checkpoint (verified against its manifest), and what happened once the link came back:

  fixed, hang watchdog       --nnodes 2, watchdog.min_seconds 15, --agent-grace 10: both end with 4; the same command
                             resumes once the link is back
  fixed, collective timeout  --nnodes 2, the watchdog off, distributed.collective_timeout 15: gloo's collective gives up,
                             both end with 4 in one line; resumed likewise
  elastic 1:2                --nnodes 1:2, watchdog.min_seconds 15, --agent-grace 60: node 0 goes on alone, node 1 ends
                             with 4; node 1 started again once the link is back is taken in, and every step is trained once

    python bench/chaos_network.py [--cases fixed-watchdog,fixed-timeout,elastic]   (root; about 8 minutes)

Each node's log and the runs' folders stay in $FINETUNE_CACHE/chaos-network (default .cache/finetune) until the next run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from common import DATA, REPO, build_model, cpu, head_commit, report

sys.path.insert(0, str(REPO / "tests"))
import netns  # noqa: E402

sys.path.insert(0, str(REPO))
from finetune.checkpoint.store import verify  # noqa: E402

WORK = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "chaos-network"
WATCH, TIMEOUT, GRACE = 15, 15, 10  # watchdog.min_seconds; distributed.collective_timeout; --agent-grace of the fixed cases
CASES = {
    "fixed-watchdog": ("2", {"watchdog": {"min_seconds": WATCH, "factor": 5}}, ["--agent-grace", str(GRACE)]),
    "fixed-timeout": ("2", {"watchdog": {"enabled": False}, "distributed": {"collective_timeout": TIMEOUT}}, ["--agent-grace", str(GRACE)]),
    "elastic": ("1:2", {"watchdog": {"min_seconds": WATCH, "factor": 5}}, ["--agent-grace", "60", "--rdzv-conf", "last_call_timeout=5"]),
}


def config(tmp: Path, model: Path, out: Path, steps: int, sections: dict) -> Path:
    cfg = {"model": {"name_or_path": str(model)}, "adapter": {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
           "data": {"train": str(DATA / "train.jsonl"), "format": "alpaca", "max_seq_len": 128},
           "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 1, "grad_accum": 2, "lr": 3e-3},
           "logging": {"report_to": [], "progress_bar": False, "plot": False}, "checkpoint": {"save_every": 10}, **sections}
    path = tmp / f"{out.name}.json"
    path.write_text(json.dumps(cfg))  # YAML reads JSON
    return path


def rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def events_of(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_case(name: str, tmp: Path, model: Path, pair: list, port: int) -> list[str]:
    nnodes, sections, options = CASES[name]
    elastic = ":" in nnodes
    out = tmp / name
    cfg = config(tmp, model, out, 400 if elastic else 100000, sections)
    launch = ["--nnodes", nnodes, "--rdzv-host", pair[0].address, "--rdzv-port", str(port), "--rdzv-id", name, *options]
    pace = {"FINETUNE_STEP_SECONDS": "0.3"} if elastic else {}  # the elastic run lasts until node 1 is back
    jobs = [netns.launch(node, tmp / f"{name}-{i}.log", *launch, config=cfg, env=pace) for i, node in enumerate(pair)]
    deadline = time.monotonic() + 300
    while len([r for r in rows(out) if "loss" in r]) < 25 and time.monotonic() < deadline and all(j.poll() is None for j in jobs):
        time.sleep(0.5)
    if any(j.poll() is not None for j in jobs) or time.monotonic() >= deadline:
        sys.exit(f"{name}: the job did not reach step 25 with both nodes: {(tmp / f'{name}-0.log').read_text()[-2000:]}")
    cut_at, cut_wall, ended = time.monotonic(), time.time(), {}
    netns.cut(pair[1])
    waiting = [1] if elastic else [0, 1]  # an elastic job's node 0 goes on
    while any(i not in ended for i in waiting) and time.monotonic() - cut_at < 300:
        ended.update({i: (j.returncode, time.monotonic() - cut_at) for i, j in enumerate(jobs) if i not in ended and j.poll() is not None})
        time.sleep(0.2)
    left = [len(netns.left_in(node)) for node in pair] if not elastic else [0, len(netns.left_in(pair[1]))]
    netns.cut(pair[1], down=False)
    saved = sorted((out / "checkpoints").glob("step-*"))
    good = saved and verify(saved[-1]) is None
    if elastic:
        resized = [e["time"] - cut_wall for e in events_of(out) if e["event"] == "resize" and e["time"] > cut_wall]
        node0 = f"went on alone {resized[0]:.1f} s after the cut (a resize)" if resized else "did NOT go on alone"
        back = netns.launch(pair[1], tmp / f"{name}-1-again.log", *launch, config=cfg, env=pace)
        codes = [jobs[0].wait(timeout=900), back.wait(timeout=300)]
        steps = [r["step"] for r in rows(out) if "loss" in r]
        resizes = sum(e["event"] == "resize" for e in events_of(out))
        after = (f"node 1 started again, taken in: both end with {codes}; {resizes} resizes; "
                 f"{len(set(steps))} of 400 steps, {'each once' if sorted(set(steps)) == list(range(1, 401)) else 'NOT each once'}")
    else:
        last = int(saved[-1].name.split("-")[1])
        resumed = [netns.launch(node, tmp / f"{name}-{i}-resumed.log", *launch, config=cfg, extra=("--set", f"train.max_steps={last + 4}"))
                   for i, node in enumerate(pair)]
        codes = [j.wait(timeout=300) for j in resumed]
        steps = [r["step"] for r in rows(out) if "loss" in r]
        after = f"the same command on both: {codes}, steps {last + 1}-{steps[-1]} trained from step-{last:06d}"
        node0 = f"{ended[0][1]:.1f} s, code {ended[0][0]}"
    return [f"| {name} | {nnodes} | {node0} | {ended[1][1]:.1f} s, code {ended[1][0]} | {sum(left)} | "
            f"{saved[-1].name if saved else 'none'} ({'verified' if good else 'NOT verified'}) | {after} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = parser.parse_args()
    why = netns.refusal()
    if why:
        sys.exit(f"chaos-network: {why}")
    lines = [f"{cpu()}, commit {head_commit()}, {time.strftime('%Y-%m-%d')}; watchdog.min_seconds {WATCH}, collective_timeout {TIMEOUT}, "
             f"--agent-grace {GRACE} (elastic: 60); LoRA on a 2-layer, 128-wide Llama, node 1's link cut after step 25", "",
             "| case | nodes | node 0 after the cut | node 1 after the cut | processes left | newest checkpoint | after the link came back |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    tmp = WORK  # kept after the run: each node's log and the runs' folders, for what the table does not say
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with netns.nodes() as pair:
        build_model(tmp / "model", layers=2, hidden=128)
        for i, name in enumerate(args.cases.split(",")):
            lines += run_case(name, tmp, tmp / "model", pair, 29640 + 2 * i)
            print(lines[-1], flush=True)
    report("chaos-network", lines)


if __name__ == "__main__":
    main()
