"""Long rows on this machine: how far one row can grow at a fixed memory per process, in one process,
with sequence parallelism over 2 processes, and with the MLP tiled too; and a tiled MLP against an
untiled one on one 16k-token row.

The model (built once, cached under $FINETUNE_CACHE/bench-long): the 1.1B Llama's widths (hidden 2048,
MLP 5632, 32 heads with 4 key/value heads, a 32k vocabulary) with 2 decoder layers and room for 64k
positions, random fp32 weights and the demo tokenizer. Two layers, not 22: a step over a row of many
thousand tokens of the whole 1.1B model takes many minutes on 2 cores, and what a long row costs per
layer is the same; the plan counts the layers. LoRA r 16 on all linear layers, fp32, gradient
checkpointing, rows packed from the demo corpus (loss on every token), one row a step.

Rows: the longest row whose plan fits BUDGET per process (plan.longest_row), then one run of it, its
peak RSS (per process) against the plan and its seconds a step:
  plain        one process
  tiled        one process, model.tiled_mlp 4
  sp2          2 processes sharing each row (distributed.sequence_parallel 2, zero2: DDP refuses tiling)
  sp2 + tiled  the same with model.tiled_mlp 4
and then 16k tokens untiled / tiled in one process.

usage: python bench/long.py [--budget-gib 2] [--steps 2] [--only plain,tiled,sp2,sp2-tiled,16k]   (make bench-long, ~30 min)
Prints a markdown table and writes it to bench/results/long.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from common import DATA, REPO, cpu_name, report
from large import train

CACHE = Path(os.environ.get("FINETUNE_CACHE", REPO / ".cache" / "finetune")) / "bench-long"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
             max_position_embeddings=65536)
GiB = 2**30
# name -> (processes, strategy, tiled_mlp, sequence_parallel)
RUNS = {"plain": (1, "none", 1, 1), "tiled": (1, "none", 4, 1), "sp2": (2, "zero2", 1, 2), "sp2-tiled": (2, "zero2", 4, 2)}


def build(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from finetune.model.tiny import build_tokenizer

        texts = [__import__("json").loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
        tok = build_tokenizer(texts)
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        LlamaForCausalLM(config).save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


def config(model: Path, out: Path, strategy: str, tiled: int, sp: int, seq: int, steps: int) -> dict:
    return {"model": {"name_or_path": str(model), "dtype": "float32", "tiled_mlp": tiled},
            "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0},
            "data": {"train": str(DATA / "corpus.jsonl"), "format": "completion", "max_seq_len": seq, "eval": None},
            "train": {"output_dir": str(out), "max_steps": steps, "micro_batch_size": 1, "lr": 1e-4, "gradient_checkpointing": True},
            "distributed": {"strategy": strategy, "sequence_parallel": sp},
            "eval": {"on_start": False}, "checkpoint": {"save_every": 0},
            "logging": {"report_to": [], "progress_bar": False, "plot": False}}


def plan_for(cfg: dict, nproc: int):
    from finetune.config.schema import validate_config
    from finetune.outputs.plan import make_plan

    checked = validate_config(cfg, "bench")
    return checked, make_plan(checked, devices=nproc, strategy=cfg["distributed"]["strategy"])


def longest(model: Path, work: Path, name: str, budget: float) -> int:
    from finetune.outputs.plan import longest_row

    nproc, strategy, tiled, sp = RUNS[name]
    cfg, plan = plan_for(config(model, work / name, strategy, tiled, sp, 1024, 1), nproc)
    return longest_row(cfg, plan.setup, budget, gpu=False) // 64 * 64


def measure(model: Path, work: Path, name: str, seq: int, steps: int) -> dict:
    nproc, strategy, tiled, sp = RUNS[name.split(" @")[0]]
    out = work / name.replace(" ", "-").replace("@", "")
    shutil.rmtree(out, ignore_errors=True)  # this bench's own run folder from an earlier round
    cfg = config(model, out, strategy, tiled, sp, seq, steps)
    _, plan = plan_for(cfg, nproc)
    run = train(work, name, nproc, cfg)
    if run["code"] != 0:
        raise SystemExit(f"{name}: exit {run['code']}\n{run['console'][-3000:]}")
    summary = run["summary"]
    held = max(run["peaks"]) - summary["rss_before_model_mib"]
    times = [m["elapsed_s"] for m in run["metrics"]]
    per_step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else times[0]
    return {"name": name, "seq": seq, "nproc": nproc, "held": held, "plan": plan.total / 2**20, "step_s": per_step,
            "losses": [m["loss"] for m in run["metrics"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, default=2.0, help="memory per process the rows must fit, by the plan (default 2)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", default="plain,tiled,sp2,sp2-tiled,16k")
    args = parser.parse_args()
    wanted = args.only.split(",")
    CACHE.mkdir(parents=True, exist_ok=True)
    model, work = build(CACHE / "model"), CACHE / "runs"
    work.mkdir(exist_ok=True)
    budget = args.budget_gib * GiB
    rows = []
    for name in [n for n in RUNS if n in wanted]:
        seq = longest(model, work, name, budget)
        print(f"{name}: the longest row planned within {args.budget_gib:g} GiB per process is {seq:,} tokens", flush=True)
        rows.append(measure(model, work, name, seq, args.steps))
        print(rows[-1], flush=True)
    if "16k" in wanted:
        for name in ("plain", "tiled"):
            rows.append(measure(model, work, f"{name} @16k", 16384, 1))
            print(rows[-1], flush=True)
    plain = next((r["seq"] for r in rows if r["name"] == "plain"), None)
    lines = [f"Long rows (bench/long.py; {cpu_name()}, {os.cpu_count()} cores): the 1.1B model's widths with "
             f"2 layers, LoRA r 16, fp32, checkpointing, one row a step; memory per process = peak RSS - RSS before the model loaded.",
             "", "| run | processes | row (tokens) | x plain | peak per process (MiB) | plan (MiB) | measured / plan | s / step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['seq'] / plain:.2f}x" if plain and "@" not in r["name"] else ""
        lines.append(f"| {r['name']} | {r['nproc']} | {r['seq']:,} | {ratio} | {r['held']:,.0f} | {r['plan']:,.0f} | {r['held'] / r['plan']:.2f} | "
                     f"{r['step_s']:.1f} |")
    lines += ["", f"Rows above the 16k ones: the longest the planner fits in {args.budget_gib:g} GiB per process. Command: "
              f"`python bench/long.py --budget-gib {args.budget_gib:g} --steps {args.steps}`."]
    report("long", lines)


if __name__ == "__main__":
    sys.exit(main())
