"""Host overhead of the GPU training path, measured on this CPU: operators, host syncs, Python time.

A GPU step is only as fast as the host can issue its kernels: every operator dispatched is a kernel
launch or more, and every host synchronisation (`.item()`, `.tolist()`, `nonzero`, a boolean mask)
stalls the host until the GPU has caught up. This runs one optimizer step at a time of

  finetune     `finetune train`'s own step with the CUDA branch selected (attention.accelerator_path and loss's replaced):
               one varlen attention call per layer, the GPU's loss chunks; torch's CUDA-only varlen
               kernel is replaced by a CPU stand-in with its signature, registered as one operator
  hf-flatten   HF Trainer + peft, DataCollatorWithFlattening (padding-free), sdpa, bf16

on the same packed data (a 1.1B-shaped Llama with 2 layers, rows of 2,048 tokens, LoRA r 16 on all
linear layers, bf16 autocast), and counts per optimizer step (the first step excluded):

  operators    ATen operators dispatched (TorchDispatchMode), forward + backward + optimizer
  syncs        operators and calls that would wait for a GPU: _local_scalar_dense (.item(), float()),
               nonzero / masked_select (boolean masks), .tolist(), .cpu()
  host ms      the step's wall time minus the time inside the operators (and minus the counters'
               own cost per operator, measured on a no-op): the Python in front of the kernels

The data step (batches read, counted and moved to the device) is left out for both: finetune's
`step_batches`, the Trainer's batch fetch. finetune runs twice, with ~9 and ~30 samples per row: no
count may grow with the samples. Writes bench/results/host.md.

Usage: python bench/host.py [--steps 4]   (make bench-host, ~5 min here)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import shutil
import time
from pathlib import Path

import torch
from common import REPO, cpu_name, report
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.repeat_interleave"}
SYNC_CALLS = {"tolist", "cpu", "numpy"}


class Counter(TorchDispatchMode):
    """Operators by name and the time spent inside them, while `on`."""

    def __init__(self):
        super().__init__()
        self.on, self.ops, self.seconds = False, collections.Counter(), 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.on:
            return func(*args, **(kwargs or {}))
        began = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - began
        self.ops[str(func.overloadpacket)] += 1
        return out


class Calls(TorchFunctionMode):
    """Python-level calls that read a tensor back to the host (they dispatch no operator on a CPU tensor)."""

    def __init__(self, counter: Counter):
        super().__init__()
        self.counter, self.calls = counter, collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.counter.on and name in SYNC_CALLS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def syncs(counter: Counter, calls: Calls) -> collections.Counter:
    found = collections.Counter({op: n for op, n in counter.ops.items() if op in SYNC_OPS})
    found.update({f".{name}()": n for name, n in calls.calls.items()})
    return found


# ------------------------------------------------------------------------------------------------
# torch's varlen kernel (CUDA only), as one CPU operator of the same signature


@torch.library.custom_op("finetune_bench::varlen", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float, left: int) -> torch.Tensor:
    return _segments(q, k, v, cu, scale, left)


@_varlen_op.register_fake
def _(q, k, v, cu, scale, left):
    return torch.empty_like(q)


@torch.library.custom_op("finetune_bench::varlen_backward", mutates_args=())
def _varlen_backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float,
                        left: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):  # attention's backward by hand: autograd is off inside an operator
        qs, ks, vs, go = (x[s:e].transpose(0, 1).float() for x in (q, k, v, grad))
        groups = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        p = torch.softmax((qs @ ks.transpose(1, 2) * scale).masked_fill(~_allowed(e - s, left), float("-inf")), dim=-1)
        dp = go @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq, dk, dv = ds @ ks, ds.transpose(1, 2) @ qs, p.transpose(1, 2) @ go
        dk, dv = (x.unflatten(0, (-1, groups)).sum(1) for x in (dk, dv))
        for g, d in zip(grads, (dq, dk, dv)):
            g[s:e] = d.transpose(0, 1).to(g.dtype)
    return tuple(grads)


def _segments(q, k, v, cu, scale: float, left: int) -> torch.Tensor:
    """The kernel's contract: causal attention within each segment of the (tokens, heads, dim) inputs."""
    out = torch.empty_like(q)
    for s, e in zip(cu.tolist(), cu.tolist()[1:]):
        qs, ks, vs = (x[s:e].transpose(0, 1) for x in (q, k, v))
        out[s:e] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=_allowed(e - s, left), scale=scale,
                                                                    enable_gqa=ks.shape[0] != qs.shape[0]).transpose(0, 1)
    return out


def _allowed(n: int, left: int) -> torch.Tensor:
    allowed = torch.ones(n, n, dtype=torch.bool).tril()
    return allowed & ~torch.ones(n, n, dtype=torch.bool).tril(-left - 1) if left >= 0 else allowed


def _setup(ctx, inputs, output):
    q, k, v, cu, scale, left = inputs
    ctx.save_for_backward(q, k, v, cu)
    ctx.scale, ctx.left = scale, left


def _backward(ctx, grad):
    q, k, v, cu = ctx.saved_tensors
    return (*_varlen_backward_op(grad, q, k, v, cu, ctx.scale, ctx.left), None, None, None)


_varlen_op.register_autograd(_backward, setup_context=_setup)


def varlen_stand_in():
    from torch.nn.attention.varlen import varlen_attn

    @functools.wraps(varlen_attn)  # the same signature: finetune reads it to choose how to pass grouped heads
    def stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **_):
        return _varlen_op(query, key, value, cu_seq_q, scale if scale is not None else query.shape[-1] ** -0.5, window_size[0])

    return stand_in


# ------------------------------------------------------------------------------------------------
# The runs


def prepare(work: Path, samples: int, max_words: int) -> dict:
    from compare import Sizes
    from compare import prepare as prepare_compare

    work.mkdir(parents=True, exist_ok=True)
    sizes = Sizes(layers=2, hidden=2048, vocab=32000, train_samples=samples, eval_samples=4, max_seq_len=2048, samples_per_step=10)
    settings = prepare_compare(work, sizes)
    if max_words:  # shorter samples: many more of them to a packed row
        from compare import make_samples

        rows = make_samples(samples, 1, max_words)
        (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return settings


def finetune_steps(work: Path, steps: int, counter: Counter, seq: int = 2048) -> dict:
    """finetune train in this process, counting inside train_step (its data step excluded) from the 2nd step."""
    from accelerate.state import AcceleratorState

    import finetune.train as train
    from finetune.config.schema import validate_config
    from finetune.model import attention
    from finetune.objectives import loss

    AcceleratorState._reset_state(True)
    cfg = {"model": {"name_or_path": str(work / "model"), "dtype": "bfloat16"},
           "adapter": {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
           "data": {"train": str(work / "train.jsonl"), "format": "alpaca", "max_seq_len": seq, "packing": True,
                    "cache_dir": str(work / "cache")},
           "train": {"output_dir": str(work / "out"), "max_steps": steps, "micro_batch_size": 1, "grad_accum": 1, "lr": 1e-4,
                     "scheduler": "constant", "mixed_precision": "bf16"},
           "logging": {"progress_bar": False, "plot": False, "log_every": 1000},
           "checkpoint": {"resume": "never"}}
    shutil.rmtree(work / "out", ignore_errors=True)
    calls, step_batches, train_step = [0], train.step_batches, train.train_step
    wall, rows = [], []

    def data_step(run, position):  # host work, left out of the counts
        on, counter.on = counter.on, False
        try:
            result = step_batches(run, position)
            rows.append(sum(len(r) - 1 for b in result[1] for r in b["position_ids"].sample_bounds))
            return result
        finally:
            counter.on = on

    def counted_step(run):
        calls[0] += 1
        counter.on = calls[0] > 1
        began = time.perf_counter()
        try:
            return train_step(run)
        finally:
            if counter.on:
                wall.append(time.perf_counter() - began)
            counter.on = False

    stand_in = varlen_stand_in()
    with _patched(train, step_batches=data_step, train_step=counted_step), _patched(attention, accelerator_path=lambda t: True,
                                                                                        _varlen=lambda: stand_in), \
            _patched(loss, accelerator_path=lambda t: True):
        train.run(validate_config(cfg, "bench-host"))
    return {"wall": wall, "samples_per_row": sum(rows[1:]) / max(len(rows) - 1, 1)}


def hf_steps(work: Path, steps: int, per_step: int, counter: Counter) -> dict:
    """HF Trainer + peft padding-free in this process, counting between on_step_begin and on_step_end."""
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainerCallback, TrainingArguments

    rows = [json.loads(line) for line in (work / "tokens.jsonl").read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.bfloat16, attn_implementation="sdpa")
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    wall = []

    class Count(TrainerCallback):
        def on_step_begin(self, _args, state, _control, **_kwargs):
            counter.on = state.global_step >= 1
            self.began = time.perf_counter()

        def on_step_end(self, _args, state, _control, **_kwargs):
            if counter.on:
                wall.append(time.perf_counter() - self.began)
            counter.on = False

    args = TrainingArguments(output_dir=str(work / "hf-out"), per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
                             max_steps=steps, learning_rate=1e-4, lr_scheduler_type="constant", max_grad_norm=1.0, optim="adamw_torch",
                             logging_steps=1000, save_strategy="no", report_to="none", use_cpu=True, bf16=True, disable_tqdm=True,
                             remove_unused_columns=False, dataloader_num_workers=0)
    dataset = Dataset.from_list([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    Trainer(model=model, args=args, train_dataset=dataset, data_collator=DataCollatorWithFlattening(), callbacks=[Count()]).train()
    return {"wall": wall, "samples_per_row": per_step}


@contextlib.contextmanager
def _patched(module, **values):
    before = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


def overhead_per_op(counter: Counter) -> float:
    """Seconds the counters add to one operator (a tiny op timed with and without them)."""
    x = torch.ones(4)
    began = time.perf_counter()
    for _ in range(2000):
        x.add(1)
    bare = time.perf_counter() - began
    counter.on = True
    began = time.perf_counter()
    for _ in range(2000):
        x.add(1)
    counted = time.perf_counter() - began
    counter.on, counter.ops, counter.seconds = False, collections.Counter(), 0.0
    return max(counted - bare, 0.0) / 2000


def measure(name: str, run, counter: Counter, calls: Calls, per_op: float) -> dict:
    counter.ops, counter.seconds, calls.calls = collections.Counter(), 0.0, collections.Counter()
    result = run()
    steps = max(len(result["wall"]), 1)
    ops = sum(counter.ops.values())
    host = sum(result["wall"]) - counter.seconds - per_op * ops
    return {"name": name, "steps": len(result["wall"]), "ops": ops / steps, "by_op": {k: v / steps for k, v in counter.ops.most_common()},
            "syncs": {k: v / steps for k, v in syncs(counter, calls).items()}, "host_ms": 1000 * host / steps,
            "step_s": sum(result["wall"]) / steps, "samples_per_row": result["samples_per_row"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is not counted")
    args = p.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    work = REPO / ".cache" / "bench" / "host"
    prepare(work / "long", 256, 0)
    (work / "short").mkdir(parents=True, exist_ok=True)
    (work / "short" / "model").exists() or os.symlink(work / "long" / "model", work / "short" / "model")
    prepare(work / "short", 512, 40)
    counter = Counter()
    calls = Calls(counter)
    with counter, calls:
        per_op = overhead_per_op(counter)
        runs = [measure("finetune", lambda: finetune_steps(work / "long", args.steps, counter), counter, calls, per_op),
                measure("finetune (short samples)", lambda: finetune_steps(work / "short", args.steps, counter), counter, calls, per_op)]
        per_row = round(runs[0]["samples_per_row"])
        runs.append(measure("hf-flatten", lambda: hf_steps(work / "long", args.steps, per_row, counter), counter, calls, per_op))
    (work / "results.json").write_text(json.dumps(runs, indent=1))
    report("host", table(runs))


def table(runs: list[dict]) -> list[str]:
    ours, peer = runs[0], runs[-1]
    lines = [f"# Host overhead of one optimizer step on the GPU path, measured on CPU ({time.strftime('%Y-%m-%d')}, "
             f"{_cpu()}, torch {torch.__version__})", "",
             "Llama, 1.1B shape with 2 layers (hidden 2048, vocabulary 32,000), LoRA r 16 on all linear layers, bf16 autocast, "
             "one packed row of 2,048 tokens a step; per optimizer step, the first step excluded; the data step excluded.", "",
             "| runner | samples a row | operators | host syncs | syncs by kind | host ms outside operators | step s (CPU) |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        kinds = ", ".join(f"{k} {v:g}" for k, v in r["syncs"].items()) or "-"
        lines.append(f"| {r['name']} | {r['samples_per_row']:.1f} | {r['ops']:.0f} | {sum(r['syncs'].values()):g} | {kinds} | "
                     f"{r['host_ms']:.0f} | {r['step_s']:.1f} |")
    same = ours["ops"] == runs[1]["ops"]
    lines += ["", "Targets: operators per step at most the peer's "
              f"({'met' if ours['ops'] <= peer['ops'] else 'NOT met'}: {ours['ops']:.0f} vs {peer['ops']:.0f}); no count that grows with "
              f"samples a row ({'met' if same else 'NOT met'}: {ours['ops']:.0f} operators at {ours['samples_per_row']:.1f} samples a row, "
              f"{runs[1]['ops']:.0f} at {runs[1]['samples_per_row']:.1f}); at most one host sync a step outside logging steps "
              f"({'met' if sum(ours['syncs'].values()) <= 1 else 'NOT met'}: {sum(ours['syncs'].values()):g}).", "",
              "Top operators per step:", "", "| operator | finetune | hf-flatten |", "|---|---|---|"]
    names = list(dict.fromkeys([*list(ours["by_op"])[:12], *list(peer["by_op"])[:12]]))
    for op in names:
        lines.append(f"| {op} | {ours['by_op'].get(op, 0):g} | {peer['by_op'].get(op, 0):g} |")
    return lines


def _cpu() -> str:
    return f"{cpu_name()}, {os.cpu_count()} CPUs"


if __name__ == "__main__":
    main()
