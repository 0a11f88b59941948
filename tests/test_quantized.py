"""QLoRA / QDoRA / 8-bit bases and the optimizers: real bitsandbytes on this machine."""

from __future__ import annotations

import pytest
import torch
from conftest import base_config, finetune_in_process, read_jsonl, run_ranks, torchrun, write_config

from finetune.config.schema import validate_config
from finetune.data.datasets import load_data
from finetune.model import nf4
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
    ({"model": {"quantization": {**QLORA, "backend": "bitsandbytes"}}, "distributed": {"strategy": "fsdp"}}, "FSDP2 drops bitsandbytes'"),
    ({"model": {"quantization": {**QLORA, "backend": "torchao"}}, "distributed": {"strategy": "zero3"}}, "it needs distributed.strategy none, ddp"),
    ({"model": {"quantization": QLORA}, "adapter": {"method": "dora"}, "distributed": {"strategy": "fsdp"}}, "it needs adapter.method: lora"),
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
            result = run_ranks(2, "finetune/train.py", "--config", config, cwd=REPO, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[nproc] = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert losses[2] == pytest.approx(losses[1], rel=1e-4), losses
    assert "lora on a 4-bit base" in result.stdout
    summary = json.loads((tmp_path / "p2" / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["param_numel_per_rank"] == [8192, 8192]  # half of the LoRA weights each



@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory, demo_tokenizer_dir):
    """Two Llama layers wide enough that each 4-bit weight holds two whole groups of 256 scales, as
    released models' do (bitsandbytes' blocks, split evenly by 2 processes)."""
    from conftest import once

    def build(out):
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        tok.save_pretrained(out)

    return once(tmp_path_factory, "nf4-model", build)


def test_qlora_under_fsdp_matches_one_process_shards_the_4bit_base_resumes_and_merges(tmp_path, nf4_model_dir):
    """FSDP2 + QLoRA (torchao's NF4, the backend fsdp picks): rank 0 reads one layer at a time from the files
    (an uninitialized skeleton otherwise), 2 processes give one process's losses and hold half of the 4-bit
    codes and scales each; a rank SIGKILLed mid-run restarts (torchrun) from the
    step-2 checkpoint and ends with the uninterrupted run's adapter, bit for bit; the adapter merges into
    a checked model."""
    import os
    import subprocess

    from conftest import REPO, strategy_config, train_strategy
    from safetensors.torch import load_file

    from finetune.outputs.merge import merge

    sections = {"model": {"quantization": QLORA}, "checkpoint": {"save_every": 2}}
    runs = {nproc: train_strategy(tmp_path, f"p{nproc}", nf4_model_dir, "lora", nproc, "fsdp", **sections) for nproc in (1, 2)}
    (_, one, single), (out, two, summary) = runs[1], runs[2]
    assert two == pytest.approx(one, rel=1e-4), (one, two)
    assert one[-1] < one[0] - 0.05, one
    console = (out / "console.log").read_text()
    assert "lora on a 4-bit base" in console and "rank 0 loads the whole model" not in console  # rank 0 streamed the layers from the files
    assert summary["strategy"] == "fsdp" and summary["nf4_bytes_per_rank"][0] == summary["nf4_bytes_per_rank"][1]
    assert 2 * summary["nf4_bytes_per_rank"][0] == single["nf4_bytes_per_rank"][0] > 0, (summary, single)

    killed = tmp_path / "killed"
    config = write_config(tmp_path / "killed.yaml", strategy_config(nf4_model_dir, killed, "lora", 2, "fsdp", **sections))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "FINETUNE_FAULT": "kill@3:rank=1"}
    job = subprocess.run([*torchrun(2), "--max-restarts", "1",
                          "finetune/train.py", "--config", str(config)], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert job.returncode == 0 and "resum" in job.stdout + job.stderr, job.stderr[-3000:]
    adapters = [load_file(folder / "adapter_model.safetensors") for folder in (out, killed)]
    assert adapters[0].keys() == adapters[1].keys() and all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])

    report = merge(str(out), str(tmp_path / "merged"), dtype="fp32")
    assert report["passed"] and report["qlora_base"] == "dequantized", report
    assert report["merged_vs_tuned"]["max"] < report["adapter_effect"]["max"] / 10, report


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nf4_made_a_chunk_at_a_time_is_torchaos_nf4_bit_for_bit(dtype):
    """nf4.to_nf4 quantizes a weight CHUNK values at a time (a torchao call holds 3.7 times a weight's bytes): on weights
    of several chunks, with a zero block and scale groups split for 1 and 4 processes, every part of the NF4 tensor (codes,
    scales, their factors and mean, the code book) and its dequantized values equal torchao's to_nf4 of the whole."""
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    weight = (torch.randn(nf4.CHUNK * 5 // 1536, 1536) * 0.02).to(dtype)  # 5 chunks, and 1,536 not a power of two
    weight[7, :64] = 0
    for shards in (1, 4):
        ours, theirs = nf4.to_nf4(weight, shards), to_nf4(weight, nf4.BLOCK, nf4.scaler_block(weight.numel(), shards))
        for part in ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4"):
            assert torch.equal(getattr(ours, part), getattr(theirs, part)), part
        assert (ours.shape, ours.dtype, ours.n_blocks, ours.scaler_block_size) == (theirs.shape, theirs.dtype, theirs.n_blocks, theirs.scaler_block_size)
        assert torch.equal(ours.get_original_weight(), theirs.get_original_weight())


def test_torchaos_nf4_is_bitsandbytes_nf4_but_for_neighbouring_codes():
    """The 4-bit codes of torchao's NF4 (the fsdp backend) against bitsandbytes' (QLoRA's) on the same bf16
    weights, blocks of 64, double-quantized scales in groups of 256: torchao keeps the code book in bf16,
    so a few values fall on the neighbouring level; the scales agree within 2% and the error is the same."""
    import bitsandbytes.functional as bnb
    from torchao.quantization import to_nf4

    torch.manual_seed(0)
    weight = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = to_nf4(weight, 64, 256)

    def codes(bytes_):
        return torch.stack([bytes_ >> 4, bytes_ & 15], -1).flatten().int()

    theirs_codes, our_codes = codes(packed.flatten()), codes(ours.quantized_data.flatten())
    assert (theirs_codes == our_codes).float().mean() > 0.99
    assert (theirs_codes - our_codes).abs().max() == 1
    theirs, mine = bnb.dequantize_4bit(packed, state).float(), ours.get_original_weight().float()
    scales = [w.reshape(-1, 64).abs().amax(1) for w in (theirs, mine)]
    assert ((scales[0] - scales[1]).abs() / scales[0]).max() < 0.02

    def rms_error(values):
        return float((values - weight.float()).pow(2).mean().sqrt())

    assert rms_error(mine) == pytest.approx(rms_error(theirs), rel=0.01)
