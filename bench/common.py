"""What the benchmarks share: the repo paths and a model of a chosen size built from config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "demo" / "data"
sys.path.insert(0, str(REPO))


def build_model(out: Path, layers: int, hidden: int, dtype: str = "float32", vocab: int | None = None, positions: int = 512) -> float:
    """A Llama-architecture model with random weights and the demo tokenizer, saved as an HF folder. MiB of weights.

    vocab: embedding rows (default: the tokenizer's); a real model's 32k+ makes the lm_head's share real."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.model.tiny import build_tokenizer

    texts = [json.loads(line)["text"] for line in (DATA / "corpus.jsonl").read_text().splitlines()[:1500]]
    tok = build_tokenizer(texts)
    config = LlamaConfig(vocab_size=vocab or len(tok), hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=positions,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def steps_and_parts(doc: str, steps: int, parts: str):
    """The options of the benchmarks that run in parts: --steps, and --only (comma-separated parts).
    Returns the arguments and whether a named part is wanted."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--only", default="", help=f"comma-separated parts: {parts}")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(",")))
    return args, lambda name: not only or name in only


def cpu_name() -> str:
    """The CPU's model name (speed figures name it: this project's machines vary)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.machine()


def head_commit(marked: bool = True) -> str:
    """The short hash of the commit a result is measured at, marked where the code measured is not that commit's
    (changes to tracked files other than results, not yet committed); marked=False: a clean clone of it is measured."""
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!bench/owed-figures.txt"],
                             cwd=REPO, capture_output=True, text=True).stdout.strip()
    return f"{head} with uncommitted changes" if changed and marked else head


def cpu() -> str:
    """The CPU as results files name it: its model, whether it has avx512-bf16 / AMX (bf16 in hardware), its cores."""
    import os

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    kinds = [kind for kind, flag in (("avx512-bf16", " avx512_bf16"), ("AMX", " amx_tile")) if flag in flags] or ["AVX2 only"]
    return f"{cpu_name()} ({', '.join(kinds)}, {os.cpu_count()} cores)"


def report(name: str, lines: list[str], results: Path = REPO / "bench" / "results") -> None:
    """Print a result table and keep it in RESULTS/NAME.md (bench/results: quoted by the README)."""
    table = "\n".join(lines)
    print(table)
    results.mkdir(parents=True, exist_ok=True)
    (results / f"{name}.md").write_text(table + "\n")


def watch(job, is_worker, every: float = 0.02) -> tuple[list[float], float]:
    """Sample a running job until it ends: (peak RSS of each worker process, MiB, highest first; peak
    of the node's total PSS over the job's processes, MiB). PSS splits pages that processes share
    (a memory-mapped file) among them instead of counting them once per process."""
    peaks: dict[int, float] = {}
    node_peak = 0.0
    while job.poll() is None:
        procs = _descendants(job.pid)
        workers = [pid for pid in procs if is_worker(pid)]
        for pid in workers:
            peaks[pid] = max(peaks.get(pid, 0.0), _kib(pid, "status", "VmRSS") / 1024)
        node_peak = max(node_peak, sum(_kib(pid, "smaps_rollup", "Pss") for pid in {*procs, job.pid}) / 1024)
        time.sleep(every)
    return sorted(peaks.values(), reverse=True), node_peak


def sample(job, is_worker, every: float = 0.25) -> tuple[list[float], list[float]]:
    """Until the job ends: each worker's peak RSS and peak anonymous RSS (MiB, highest first). The
    second leaves out clean pages of mapped files (a safetensors file read while a bf16 model is
    converted to fp32), which are page cache the kernel drops under pressure, not memory held."""
    rss, anon = {}, {}
    while job.poll() is None:
        for pid in [p for p in _descendants(job.pid) if is_worker(p)]:
            rss[pid] = max(rss.get(pid, 0.0), _kib(pid, "status", "VmRSS") / 1024)
            anon[pid] = max(anon.get(pid, 0.0), _kib(pid, "status", "RssAnon") / 1024)
        time.sleep(every)
    return sorted(rss.values(), reverse=True), sorted(anon.values(), reverse=True)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found or [pid]


def _kib(pid: int, file: str, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def spawn(cmd: list[str], log: Path) -> tuple[float, int]:
    """Run cmd as a fresh process from the repository (its PYTHONPATH first, offline); (start time, peak RSS in bytes).
    Fails loudly with the log's tail."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    with log.open("w") as fh:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; the end of {log}:\n" + "\n".join(log.read_text().splitlines()[-15:]))
    return start, usage.ru_maxrss * 1024


def loss_and_grads(model, fn) -> tuple[float, dict]:
    """fn()'s value (a loss) and the gradients it gives each parameter that gets one."""
    model.zero_grad()
    value = fn()
    value.backward()
    return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
