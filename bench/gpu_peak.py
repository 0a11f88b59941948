"""Where a run's peak GPU memory goes: runs `finetune train` in this process with torch's allocator
history on, replays the history to the moment the most memory was allocated, and prints the tensors
alive then, grouped by the line of finetune, transformers, peft or DeepSpeed that allocated them.

What `finetune plan` counts as weights, gradients, optimizer states and activations is, on a GPU, a
set of tensors the caching allocator holds at one instant; this shows which, so a plan that is off
can be told which term it misses. CUDA only (the history is the CUDA allocator's).

usage: python bench/gpu_peak.py --config C.yaml [--set KEY=VALUE ...] [--top 25] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch

OURS = ("finetune/", "transformers/", "peft/", "deepspeed/", "accelerate/", "torch/utils/checkpoint", "torch/autograd/graph")


def where(frames: list[dict]) -> str:
    """The innermost frame in a library this run goes through (torch's own kernels say little)."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS):
            short = name.split("site-packages/")[-1].split("/work/main/")[-1]
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame)"


def peak_blocks(trace: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    """Replays one device's allocator events; the most bytes allocated at once and the blocks alive then."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], where(event.get("frames", [])))
            now += event["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif event["action"] == "free_requested" and event["addr"] in live:
            now -= live.pop(event["addr"])[0]
    return peak, at_peak


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_peak.py: needs a CUDA GPU (it reads the CUDA allocator's history)")
    from finetune.config.files import load_config
    from finetune.train import run

    cfg = load_config(args.config, args.set)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    run(cfg)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = peak_blocks(snapshot["device_traces"][0])
    by_line = collections.defaultdict(lambda: [0, 0])
    for size, line in blocks:
        if line == "(no Python frame)":  # made by autograd's engine in the backward: told apart by size
            line = f"(backward, no Python frame) blocks of {size / 2**20:.1f} MiB"
        by_line[line][0] += size
        by_line[line][1] += 1
    rows = sorted(by_line.items(), key=lambda item: -item[1][0])[: args.top]
    lines = [f"peak allocated {peak / 2**20:.0f} MiB ({args.config} {' '.join(args.set)}); torch {torch.__version__}, {torch.cuda.get_device_name()}",
             "", "| MiB | tensors | allocated at |", "| ---: | ---: | --- |"]
    lines += [f"| {size / 2**20:.1f} | {count} | {line} |" for line, (size, count) in rows]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
