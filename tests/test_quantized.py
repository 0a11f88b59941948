"""QLoRA / QDoRA / 8-bit bases and the optimizers: real bitsandbytes on this machine."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config, finetune_in_process, read_jsonl, write_config

from finetune.config.schema import validate_config
from finetune.data.datasets import load_data
from finetune.model.loading import load_model, load_tokenizer
from finetune.train import run

QLORA = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_qlora_learns_and_the_adapter_reloads_on_a_fresh_4bit_base(tmp_path, demo_model_dir, ram_root, method):
    """Trained from a staged RAM copy of the base (model.ramdisk); reloaded on one quantized from the source."""
    from peft import PeftModel

    out = tmp_path / "out"
    # fp32 compute here so that "identical logits" can be checked to 1e-5 (bf16 rounds at ~1e-2).
    cfg = validate_config(base_config(
        demo_model_dir, out, model={"quantization": {**QLORA, "compute_dtype": "float32"}, "ramdisk": str(ram_root / "qlora")},
        adapter={"method": method, "r": 8},
        train={"max_steps": 25, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 3},
        eval={"on_start": True},
    ), "test")
    result = run(cfg)
    assert result.summary["model_loaded_from"].startswith(str(ram_root / "qlora"))
    evals = [r["eval_loss"] for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    assert evals[-1] < 0.5 * evals[0], evals

    adapter_bytes = (out / "adapter_model.safetensors").stat().st_size
    base_bytes = (demo_model_dir / "model.safetensors").stat().st_size
    print(f"{method}: adapter {adapter_bytes / 2**20:.2f} MiB vs base {base_bytes / 2**20:.2f} MiB")
    assert adapter_bytes < 0.12 * base_bytes

    tok = load_tokenizer(cfg.model)
    batch = load_data(cfg.data, tok, 0).eval.batch([0, 1], tok.pad_token_id)
    fresh = PeftModel.from_pretrained(load_model(cfg.model), out).eval()
    trained = result.model.eval()
    kwargs = dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    with torch.no_grad():
        a, b = trained(**kwargs).logits, fresh(**kwargs).logits
    assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_a_4bit_base_keeps_one_kernel_through_eval_on_any_cpu_device(tiny_model_dir, device):
    """A rank of a multi-process run loads onto "cpu:0": there too the first eval-mode forward must not
    repack the 4-bit weights for bitsandbytes' bf16 kernel (no autograd; logits move), which it did
    while the guard matched the device by its name "cpu" alone."""
    from finetune.config.schema import ModelConfig, QuantizationConfig

    cfg = ModelConfig(name_or_path=str(tiny_model_dir), quantization=QuantizationConfig(**{**QLORA, "compute_dtype": "float32"}))
    model = load_model(cfg, torch.device(device), say=lambda _: None)
    ids = torch.arange(3, 11)[None]
    with torch.no_grad():
        first, again = (model.eval()(input_ids=ids, use_cache=False).logits for _ in range(2))
    assert torch.equal(first, again)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu"))


def test_8bit_base_with_lora_trains(tmp_path, demo_model_dir):
    out = tmp_path / "out"
    cfg = validate_config(base_config(
        demo_model_dir, out, model={"quantization": {"bits": 8}}, train={"max_steps": 15, "micro_batch_size": 8, "lr": 3e-3},
        eval={"on_start": True},
    ), "test")
    run(cfg)
    evals = [r["eval_loss"] for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    assert evals[-1] < 0.7 * evals[0], evals


@pytest.mark.parametrize("sections,words", [
    ({"model": {"quantization": {"bits": 8}}, "adapter": {"method": "dora"}}, "8-bit + DoRA fails inside bitsandbytes"),
    ({"model": {"quantization": QLORA}, "adapter": {"method": "full"}}, "quantized weights cannot be fully fine-tuned"),
    ({"model": {"quantization": {**QLORA, "compute_dtype": "float16"}}}, "float16 compute with a quantized base is GPU-only"),
    ({"train": {"optimizer_offload": True}}, "needs a CUDA GPU"),
    ({"model": {"quantization": QLORA}, "distributed": {"strategy": "fsdp"}}, "fsdp cannot shard a quantized base"),
    ({"model": {"quantization": {"bits": 8}}, "distributed": {"strategy": "zero3"}}, "an 8-bit base is not supported under zero3"),
])
def test_impossible_combinations_refused_before_loading(tmp_path, tiny_model_dir, sections, words):
    if torch.cuda.is_available():
        pytest.skip("CPU-only refusals")
    cfg = base_config(tiny_model_dir, tmp_path / "out", **sections)
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert words in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_4bit_refuses_widths_the_cpu_kernel_cannot_pack(tmp_path, tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("CPU-only refusal")
    import json
    import shutil

    odd = tmp_path / "odd-model"
    shutil.copytree(tiny_model_dir, odd)
    config = json.loads((odd / "config.json").read_text())
    config["intermediate_size"] = 100
    (odd / "config.json").write_text(json.dumps(config))
    cfg = base_config(odd, tmp_path / "out", model={"quantization": QLORA})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2 and "intermediate_size=100" in result.stderr


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion", "lion_8bit", "sgd"])
def test_each_optimizer_steps(tmp_path, tiny_model_dir, optimizer):
    cfg = validate_config(base_config(tiny_model_dir, tmp_path / "out", adapter={"method": "full"},
                                      data={"eval": None}, train={"max_steps": 2, "optimizer": optimizer, "lr": 1e-3}), "test")
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    after = run(cfg).model.state_dict()
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    steps_lr = 1e-3 + 0.5e-3  # the two steps' learning rates (cosine over 2 steps: lr, then half of it)
    if optimizer == "sgd":
        assert 1e-5 < moved < steps_lr, moved  # lr x gradient, and this model's gradient entries are below 1
    else:
        # Adam's first updates and Lion's (a sign) are about lr in size whatever the gradient: the largest change is the sum
        # of the steps' rates (measured 1.50e-3; the 8-bit states round it to 1.60e-3). A wrong rate or no step misses it.
        assert 0.95 * steps_lr < moved < 1.1 * steps_lr, moved


@pytest.mark.parametrize("strategy", ["zero3"])  # zero3_offload + QLoRA ran the same when tried by hand
def test_qlora_under_zero3_matches_one_process_and_partitions_the_4bit_base(tmp_path, tiny_model_dir, strategy):
    """ZeRO-3 + QLoRA with 2 processes (4-bit values stored in the weights' dtype so ZeRO partitions
    them): the same per-step losses as one QLoRA process with the same global batch."""
    import json
    import os
    import subprocess
    import sys

    from conftest import REPO

    losses = {}
    for nproc in (1, 2):
        out = tmp_path / f"p{nproc}"
        cfg = base_config(tiny_model_dir, out, model={"quantization": {**QLORA, "compute_dtype": "float32"}}, data={"eval": None},
                          train={"max_steps": 4, "micro_batch_size": 4 // nproc, "lr": 1e-2}, distributed={"strategy": strategy})
        config = str(write_config(tmp_path / f"p{nproc}.yaml", cfg))
        if nproc == 1:
            result = finetune_in_process("train", "--config", config)
        else:
            env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
            result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                     "finetune/train.py", "--config", config], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[nproc] = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert losses[2] == pytest.approx(losses[1], rel=1e-4), losses
    assert "lora on a 4-bit base" in result.stdout
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["param_numel_per_rank"] == [8192, 8192]  # half of the LoRA weights each
