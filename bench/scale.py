"""`make bench-scale`: the planned and the simulated per-rank memory and collectives of one FSDP2 training
step, for Llama-3.1-8B, Llama-2-70B, Qwen2.5-72B and Llama-3.1-405B shapes at 8, 64 and 512 GPUs, LoRA,
QLoRA (torchao's NF4 base) and full fine-tuning. From the published config.json files in docs/examples/
alone, on this CPU machine: `finetune plan --simulate` runs each step on fake tensors (outputs/simulate.py).

Settings: bf16 weights, LoRA r 16 on every linear layer (dropout 0.05, the shipped configs'), AdamW,
gradient checkpointing, one 4,096-token row a micro-batch, distributed.strategy fsdp. Each simulation
runs in a fresh process, as the command does; results are kept in bench/results/scale.json as they come,
each with the commit it ran at (a rerun skips those there; delete the file to run all again), and the
table is bench/results/scale.md.

usage: python bench/scale.py [--only MODEL]   (about 90 minutes on a 2-core CPU for all 36)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import REPO, cpu_name, report

sys.path.insert(0, str(REPO))
from finetune.config.schema import validate_config  # noqa: E402
from finetune.outputs.plan import GiB, make_plan, step_time  # noqa: E402
from finetune.outputs.simulate import NOT_TENSORS  # noqa: E402

MODELS = {"llama-3.1-8b": "Llama-3.1-8B", "llama-2-70b": "Llama-2-70B", "qwen2.5-72b": "Qwen2.5-72B", "llama-3.1-405b": "Llama-3.1-405B"}
METHODS = ("lora", "full", "qlora")  # QLoRA last: quantizing fake layers takes the longest
WORLDS = (8, 64, 512)
RESULTS = REPO / "bench" / "results" / "scale.json"


def config(model: str, method: str):
    raw = {"model": {"name_or_path": str(REPO / "docs" / "examples" / model), "dtype": "bfloat16"},
           "data": {"train": "unused.jsonl", "max_seq_len": 4096},
           "adapter": {"method": "full" if method == "full" else "lora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"},
           "train": {"micro_batch_size": 1, "grad_accum": 1, "gradient_checkpointing": True, "optimizer": "adamw", "mixed_precision": "bf16"},
           "distributed": {"strategy": "fsdp"}}
    if method == "qlora":
        raw["model"]["quantization"] = {"bits": 4}  # backend auto: torchao under fsdp
    return validate_config(raw, "bench-scale", check_paths=False)


def simulate_one(model: str, method: str, world: int) -> dict:
    """In this process: one simulated step, as JSON-ready numbers."""
    from finetune.outputs.simulate import simulate

    sim = simulate(config(model, method), world)
    return {"peak": sim.peak, "total": sim.total, "moved": sim.moved, "seconds": sim.seconds,
            "collectives": {name: calls for name, (calls, _) in sim.collectives.items()}}


def row(model: str, method: str, world: int, sim: dict) -> str:
    cfg = config(model, method)
    plan = make_plan(cfg, devices=world, gpu=True)
    tensors = plan.total - sum(plan.rows.get(name, 0.0) for name in NOT_TENSORS)
    comm = step_time(cfg, plan.setup, 1.0, 1.0, 0.0).comm_bytes
    top = sorted(sim["peak"].items(), key=lambda item: -item[1])[:3]
    return (f"| {MODELS[model]} | {method} | {world} | {tensors / GiB:.2f} ({plan.moment}) | {sim['total'] / GiB:.2f} | "
            f"{(tensors - sim['total']) / sim['total']:+.0%} | " + ", ".join(f"{role} {size / GiB:.2f}" for role, size in top)
            + f" | {comm / 1e9:.3g} / {sim['moved'] / 1e9:.3g} | {sim['seconds']:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(MODELS), help="one model shape")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "METHOD", "WORLD"), help=argparse.SUPPRESS)  # a worker: one simulation
    args = parser.parse_args()
    if args.one:
        print(json.dumps(simulate_one(args.one[0], args.one[1], int(args.one[2]))))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    done = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"runs": {}}
    for method in METHODS:
        for model in [args.only] if args.only else MODELS:
            for world in WORLDS:
                key = f"{model} {method} {world}"
                if key in done["runs"]:
                    continue
                started = time.time()
                job = subprocess.run([sys.executable, __file__, "--one", model, method, str(world)], cwd=REPO, capture_output=True, text=True)
                if job.returncode:
                    sys.exit(f"{key}: {job.stderr.strip().splitlines()[-1]}")
                done["runs"][key] = {**json.loads(job.stdout.strip().splitlines()[-1]), "commit": commit, "date": time.strftime("%Y-%m-%d")}
                RESULTS.write_text(json.dumps(done, indent=1) + "\n")
                print(f"{key}: {time.time() - started:.0f} s", flush=True)
    lines = ["| model | method | GPUs | plan: tensors per GPU, GiB (its peak) | simulated peak, GiB | plan vs simulated | simulated, largest roles (GiB) "
             "| collectives per GPU a step, GB: plan / simulated | simulation took |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [row(*key.split()[:2], int(key.split()[2]), sim) for key, sim in done["runs"].items()]
    when = sorted({f"{sim['commit']} on {sim['date']}" for sim in done["runs"].values()})
    lines += ["", f"Simulated at {', '.join(when)} on {cpu_name()} ({os.cpu_count()} cores): `make bench-scale` (bench/scale.py)."]
    report("scale", lines)


if __name__ == "__main__":
    main()
