"""Which CPU attention kernel a packed sample should take, measured on this machine.

kernels: one causal sample's forward and backward, finetune's kernel (model/attention.py's causal_attention: batched
matmuls around an fp32 softmax, probabilities kept) against torch's sdpa (its CPU flash kernel), in fp32 and bf16, at
lengths around SHORT_SAMPLE (the length up to which finetune takes its own kernel on a CPU). One thread, 8 query heads
and 4 key/value heads of 64.

sinks: gpt-oss's attention with sinks, one sample of 4,096 tokens in bf16 at gpt-oss-20b's heads (64 of 64, 8 key/value
heads): finetune's kernel (past KEPT_PROBS it recomputes its probabilities a head chunk at a time) against torch's sdpa
with a sink key (_with_sink_key), seconds and the process's peak RSS growth, each in a process of its own.

Usage: python bench/attention.py [--only kernels,sinks]   (make bench-attention, ~3 min)
Prints the tables and writes them to bench/results/attention.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import REPO, cpu, head_commit, report, steps_and_parts

LENGTHS = (128, 256, 512, 1024)
HEADS, KV_HEADS, DIM = 8, 4, 64


def timed(step, flops: float) -> float:
    """Seconds one call of `step` takes, after one untimed, over enough calls for ~2 s of work."""
    step()
    calls = max(3, int(2e9 / flops))
    began = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - began) / calls


def kernels() -> list[str]:
    import torch
    import torch.nn.functional as F

    from finetune.model import attention

    torch.manual_seed(0)
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        for length in LENGTHS:
            q = torch.randn(1, HEADS, length, DIM, dtype=dtype, requires_grad=True)
            k, v = (torch.randn(1, KV_HEADS, length, DIM, dtype=dtype, requires_grad=True) for _ in range(2))
            grad = torch.randn(1, length, HEADS, DIM, dtype=dtype)

            def ours():
                attention.causal_attention(q, k, v, [(0, 0, length)], DIM**-0.5).backward(grad)

            def torchs():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).backward(grad)

            flops = 4 * length * length * HEADS * DIM  # causal: half of 2 matmuls forward, 4 backward
            mine, theirs = timed(ours, flops), timed(torchs, flops)
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {length} | {mine * 1e3:.2f} | {theirs * 1e3:.2f} | {theirs / mine:.2f} |")
            print(lines[-1], flush=True)
    return lines


def sink_run(path: str) -> dict:
    """The child's work: one gpt-oss-20b-shaped sample with sinks, forward and backward, by `path`."""
    import resource

    import torch

    from finetune.model import attention

    length, heads, kv_heads, dim = 4096, 64, 8, 64
    q = torch.randn(1, heads, length, dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, length, dim, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, length, heads, dim, dtype=torch.bfloat16)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    began = time.perf_counter()
    if path == "finetune's kernel":
        out = attention.causal_attention(q, k, v, [(0, 0, length)], dim**-0.5, sinks=sinks)
    else:
        out = attention._with_sink_key(q, k, v, attention._sink_mask(length, None, torch.bfloat16, q.device), dim**-0.5, sinks)
    out.backward(grad)
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "peak_growth_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def sinks() -> list[str]:
    lines = []
    for path in ("finetune's kernel", "sdpa with a sink key"):
        done = subprocess.run([sys.executable, __file__, "--sink-child", path], capture_output=True, text=True, check=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        lines.append(f"| {path} | {result['seconds']:.2f} s | {result['peak_growth_mib']:,.0f} MiB |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--sink-child"]:
        print(json.dumps(sink_run(sys.argv[2])))
        return
    import torch

    torch.set_num_threads(1)
    _, wanted = steps_and_parts(__doc__, 1, "kernels, sinks")
    lines = [f"{cpu()}, commit {head_commit()}, {time.strftime('%Y-%m-%d')}, one thread"]
    if wanted("kernels"):
        lines += ["", f"one causal sample, forward and backward, {HEADS} query heads and {KV_HEADS} key/value heads of {DIM}", "",
                  "| dtype | tokens | finetune's kernel (ms) | torch's sdpa (ms) | torch's time / finetune's |", "| --- | --- | --- | --- | --- |",
                  *kernels()]
    if wanted("sinks"):
        lines += ["", "gpt-oss-20b's attention with sinks: one sample of 4,096 tokens, bf16, 64 query heads and 8 key/value heads of 64, "
                  "forward and backward", "", "| path | time | peak RSS growth |", "| --- | --- | --- |", *sinks()]
    report("attention", lines)


if __name__ == "__main__":
    main()
