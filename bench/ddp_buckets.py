"""What DDP's gradient buckets hold: rank 0's peak RSS of two gloo processes training eight 4096 x 4096 fp32 layers
(512 MiB of weights) for 3 SGD steps, with DDP's default buckets and with `gradient_as_bucket_view=True`, each without
and with gradient accumulation (a `no_sync` micro-batch before each synchronizing one, `zero_grad(set_to_none=True)`).
What `finetune plan`'s "gradient buckets (DDP)" row counts. Writes bench/results/ddp-buckets.md.

Usage: python bench/ddp_buckets.py   (make bench-ddp-buckets, under a minute)
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO, cpu, head_commit, report

RANK = """
import resource, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
view, accumulate = sys.argv[1] == "1", sys.argv[2] == "1"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)])
ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    if accumulate:
        with ddp.no_sync():
            ddp(torch.randn(4, 4096)).sum().backward()
    ddp(torch.randn(4, 4096)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
if dist.get_rank() == 0:
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
dist.destroy_process_group()
"""


def peak(script: Path, view: bool, accumulate: bool) -> int:
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(int(view)),
                          str(int(accumulate))], capture_output=True, text=True, check=True, cwd=REPO)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "rank.py"
        script.write_text(RANK)
        rows = [(accumulate, peak(script, False, accumulate), peak(script, True, accumulate)) for accumulate in (False, True)]
    lines = [f"{cpu()}, commit {head_commit()}: rank 0's peak RSS, MiB, 2 gloo processes, 512 MiB of fp32 weights, 3 SGD steps", "",
             "| micro-batches a step | DDP's buckets (default) | gradient_as_bucket_view | saved |", "| --- | --- | --- | --- |"]
    lines += [f"| {2 if accumulate else 1} | {default:,} | {view:,} | {default - view:,} |" for accumulate, default, view in rows]
    report("ddp-buckets", lines)


if __name__ == "__main__":
    main()
