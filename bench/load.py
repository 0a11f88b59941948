"""How long does loading a model take: from disk (cold, warm), from a staged RAM copy, against the floor?

Builds a Llama-architecture model of about 0.9 GB (bf16, random weights; kept in .cache/bench-load
for later runs), stages it with `finetune stage`, then times, each in a fresh process and after the
imports (median of --repeat runs):

  load    finetune's own load_model (transformers from_pretrained, safetensors memory-mapped)
  ready   load, then every weight read once (a sum over each parameter): what a memory-mapped load
          defers to the first step is counted here
  floor   a plain sequential read of the same safetensors bytes from the RAM copy into a reused
          16 MiB buffer: no loader can be faster

Rows: disk with a cold page cache (needs root to drop the caches; the row says so when it cannot),
disk warm, the staged copy in its stored dtype, and the staged copy converted to float32 (what a
model.dtype other than the stored one costs). Target: staged, ready within 1.5x the floor.

Usage: python bench/load.py [--layers 16] [--hidden 1536] [--repeat 5]   (make bench-load)
Prints a markdown table and writes bench/results/load.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, build_model, report

ROOT = Path("/dev/shm/finetune-bench")

# Runs in a fresh process; prints one JSON line. Imports happen before the clock starts.
PROBE = r"""
import json, sys, time
mode, path, dtype = sys.argv[1:4]
if mode == "floor":
    from pathlib import Path
    buf = memoryview(bytearray(16 << 20))
    start, n = time.perf_counter(), 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    print(json.dumps({"ready": time.perf_counter() - start, "bytes": n}))
    sys.exit()
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from finetune.config.schema import ModelConfig
from finetune.model.loading import load_model
start = time.perf_counter()
model = load_model(ModelConfig(name_or_path=path, dtype=dtype))
loaded = time.perf_counter()
with torch.no_grad():
    for p in model.parameters():
        p.sum()
print(json.dumps({"load": loaded - start, "ready": time.perf_counter() - start}))
"""


def probe(mode: str, path: Path, dtype: str = "auto") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TRANSFORMERS_VERBOSITY": "error",
           "HF_HUB_DISABLE_PROGRESS_BARS": "1", "DS_ACCELERATOR": "cpu"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(path), dtype], cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{mode} {path} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_caches() -> bool:
    """Empty the page cache (root only) so the next read comes from the disk itself."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_all(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            while fh.read(16 << 20):
                pass


def median_of(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "bytes"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    src = REPO / ".cache" / "bench-load" / f"llama-{args.layers}x{args.hidden}-bf16"
    if not (src / "model.safetensors").is_file():
        print(f"building {src} ...", flush=True)
        build_model(src, args.layers, args.hidden, "bfloat16")
    from finetune.model import stage

    if ROOT.is_dir():
        stage.evict(ROOT, None)
    read_all(src)  # staging from a warm cache: the copy itself, not the disk, is timed
    first = stage.stage(str(src), ROOT, reserve_gib=1.0, say=lambda _: None)
    again = stage.stage(str(src), ROOT, reserve_gib=1.0, say=lambda _: None)
    staged = first.path
    gib = first.nbytes / 2**30

    # The warm runs take turns, so that the machine's drift (a busy neighbour) touches all alike.
    read_all(src)
    warm: dict[str, list[dict]] = {"disk": [], "staged": [], "staged fp32": [], "floor": []}
    for _ in range(args.repeat):
        warm["floor"].append(probe("floor", staged))
        warm["staged"].append(probe("load", staged))
        warm["disk"].append(probe("load", src))
        warm["staged fp32"].append(probe("load", staged, "float32"))
    floor = median_of(warm["floor"])
    # Cold runs last: on this VM, dropping the page cache leaves a tmpfs file's pages 3-5x slower to
    # map until it is rewritten (docs/platform-notes.md), which would taint the staged rows.
    cold = []
    for _ in range(args.repeat):
        if not drop_caches():
            break
        cold.append(probe("load", src))
    rows: list[tuple[str, dict | None, str]] = [
        ("disk, cold page cache", median_of(cold) if cold else None, "" if cold else "not measured: dropping the page cache needs root"),
        ("disk, warm page cache", median_of(warm["disk"]), ""),
        ("staged RAM copy, stored dtype (bf16)", median_of(warm["staged"]), "zero-copy: the mapped pages are the weights"),
        ("staged RAM copy, converted to float32", median_of(warm["staged fp32"]), "model.dtype differs from the stored dtype: a converted copy"),
        ("floor: sequential read of the RAM copy", floor, "plain read() into a reused buffer"),
    ]
    stage.evict(ROOT, None)

    lines = [f"Model: {gib:.2f} GiB of safetensors ({args.layers} layers, hidden {args.hidden}, bf16). "
             f"{platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}; median of {args.repeat} fresh processes, "
             "imports excluded.", "",
             f"Staging (`finetune stage`, source in the page cache): {first.seconds:.2f} s to copy and verify "
             f"({gib / first.seconds:.2f} GiB/s); a later run finds it current in {again.seconds * 1000:.0f} ms.", "",
             "| load from | load (s) | ready: every weight read once (s) | ready / floor | note |", "|---|---|---|---|---|"]
    for name, r, note in rows:
        if r is None:
            lines.append(f"| {name} | - | - | - | {note} |")
            continue
        load = f"{r['load']:.3f}" if "load" in r else "-"
        lines.append(f"| {name} | {load} | {r['ready']:.3f} | {r['ready'] / floor['ready']:.2f}x | {note} |")
    staged_ratio = rows[2][1]["ready"] / floor["ready"]
    lines += ["", f"Target: staged copy ready within 1.5x the floor: {staged_ratio:.2f}x, {'met' if staged_ratio <= 1.5 else 'NOT met'}."]
    report("load", lines)


if __name__ == "__main__":
    main()
