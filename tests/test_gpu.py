"""The CUDA paths on a real NVIDIA GPU: the `gpu` marker, skipped where CUDA is absent (CI has none).

    python -m pytest -m gpu tests/test_gpu.py -v      (on a machine with an NVIDIA GPU)

What the CPU tests prove for the CPU paths, here for the CUDA ones: bf16 LoRA/DoRA/full training
learns and the saved adapter reloads with the same logits; QLoRA through bitsandbytes' CUDA kernels
with a paged 8-bit optimizer; attention over packed rows and the fused loss equal the plain paths on
CUDA; fp8 through torchao; nccl under torchrun; FSDP2 with CPU offload; optimizer states offloaded.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    FAMILIES,
    MOE,
    REPO,
    base_config,
    documented_varlen,
    free_port,
    loss_and_grads,
    packed_batch,
    read_jsonl,
    run_cli,
    samples_batch,
    textbook,
    textbook_samples,
    torchrun,
    trained_grads,
    write_config,
)

from finetune.config.schema import validate_config
from finetune.train import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QLORA = {"bits": 4, "quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
BF16 = {"model": {"dtype": "bfloat16"}, "data": {"eval": None}}


def _train(tmp_path, model_dir, name="out", **sections):
    """A run of `max_steps` on the demo data; (result, per-step losses, summary)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # a second run in one test may take another precision
    out = tmp_path / name
    merged = {k: dict(v) for k, v in BF16.items()}
    for key, values in sections.items():
        merged.setdefault(key, {}).update(values)
    merged["train"] = {"max_steps": 30, "micro_batch_size": 8, "lr": 3e-3, "mixed_precision": "bf16", **merged.get("train", {})}
    result = run(validate_config(base_config(model_dir, out, **merged), "test"))
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    return result, losses, json.loads((out / "summary.json").read_text())


def _eval_batch(model_dir):
    from finetune.data.datasets import load_data
    from finetune.model.loading import load_tokenizer

    cfg = validate_config(base_config(model_dir, "unused"), "test")
    tok = load_tokenizer(cfg.model)
    batch = load_data(cfg.data, tok, 0).eval.batch([0, 1], tok.pad_token_id)
    return {"input_ids": batch["input_ids"].cuda(), "position_ids": batch["position_ids"].cuda(), "use_cache": False}


def _logits(model, batch):
    """Under bf16 autocast, as the trained model's forward runs (accelerate wraps it): the fp32 adapter then multiplies in bf16 alike."""
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        return model.eval()(**batch).logits.float()


@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_bf16_training_on_cuda_learns_and_the_saved_model_reloads(tmp_path, tiny_model_dir, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, losses, summary = _train(tmp_path, tiny_model_dir, adapter={"method": method}, train={"lr": 3e-3 if method == "full" else 1e-2})
    assert next(result.model.parameters()).device.type == "cuda"
    assert losses[-1] < 0.9 * losses[0], losses
    assert 0 < summary["peak_gpu_mib"] < 2000, summary["peak_gpu_mib"]
    out = tmp_path / "out"
    if method == "full":
        fresh = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).cuda()
    else:
        fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda(), out)
    batch = _eval_batch(tiny_model_dir)
    a, b = _logits(result.model, batch), _logits(fresh, batch)
    untuned = _logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda(), batch)
    print(f"{method}: reload max |diff| {(a - b).abs().max().item():.2e}, vs untuned {(a - untuned).abs().max().item():.2e}")
    assert (a - b).abs().max() < 1e-5
    assert (a - untuned).abs().max() > 1e-2


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_qlora_on_cuda_kernels_with_a_paged_8bit_optimizer(tmp_path, demo_model_dir, method):
    import bitsandbytes as bnb
    from peft import PeftModel

    from finetune.model.loading import load_model

    result, losses, summary = _train(tmp_path, demo_model_dir, model={"quantization": QLORA}, adapter={"method": method},
                                     train={"optimizer": "paged_adamw_8bit", "max_steps": 25})
    quantized = [m for m in result.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(m.weight.device.type == "cuda" and m.weight.quant_state.quant_type == "nf4" for m in quantized)
    assert all(m.weight.quant_state.nested for m in quantized)  # double quantization
    assert losses[-1] < 0.7 * losses[0], losses
    cfg = validate_config(base_config(demo_model_dir, tmp_path / "out", model={"dtype": "bfloat16", "quantization": QLORA}), "test")
    fresh = PeftModel.from_pretrained(load_model(cfg.model, "cuda"), tmp_path / "out")
    batch = _eval_batch(demo_model_dir)
    a, b = _logits(result.model, batch), _logits(fresh, batch)
    print(f"q{method}: losses {losses[0]:.3f} -> {losses[-1]:.3f}, reload max |diff| {(a - b).abs().max().item():.2e}, "
          f"peak GPU {summary['peak_gpu_mib']:.0f} MiB")
    assert (a - b).abs().max() < 1e-5



def test_qlora_on_cuda_killed_then_resumed_gives_the_same_losses(tmp_path, demo_model_dir):
    """A 4-bit base, an adapter with dropout (CUDA's RNG state matters) and the paged 8-bit optimizer:
    SIGKILL after the checkpoint of step 4, resume, and the losses are the uninterrupted run's, bitwise."""
    def config(name):
        return write_config(tmp_path / f"{name}.yaml", base_config(
            demo_model_dir, tmp_path / name, model={"dtype": "bfloat16", "quantization": QLORA}, adapter={"dropout": 0.1},
            data={"eval": None}, train={"max_steps": 8, "micro_batch_size": 4, "lr": 1e-3, "mixed_precision": "bf16",
                                        "optimizer": "paged_adamw_8bit"}))

    def losses(name):
        return {r["step"]: r["loss"] for r in read_jsonl(tmp_path / name / "metrics.jsonl") if "loss" in r}

    assert run_cli("train", "--config", str(config("reference"))).returncode == 0
    killed = run_cli("train", "--config", str(config("out")), "--save-every", "4", env={"FINETUNE_FAULT": "kill@5"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = run_cli("train", "--config", str(config("out")), "--save-every", "4")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "step-000004 at step 4" in resumed.stdout
    expected, got = losses("reference"), losses("out")
    print(f"qlora resume: {[f'{got[s] - expected[s]:.1e}' for s in sorted(expected)]}")
    assert got == expected


def _packed_batch_cuda(model_dir):
    return {k: v.cuda() for k, v in packed_batch(model_dir).items()}


def _attention_path(monkeypatch, path: str) -> None:
    """varlen: torch's flash varlen kernel, one call per layer (torch >= 2.11); sdpa-mask: transformers'
    sdpa over its block-diagonal mask, which finetune falls back to where varlen cannot run."""
    from finetune.model import attention

    if path == "sdpa-mask":
        monkeypatch.setattr(attention, "_varlen", lambda: None)
    elif attention._varlen() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn(window_size=...)")


@pytest.mark.parametrize("kv_heads", [2, 8], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, 3])
def test_the_cpu_stand_in_for_varlen_is_the_real_kernel(kv_heads, window):
    """tests/test_fast_paths.py checks the varlen layout on CPU against a stand-in written from
    varlen_attn's documented contract; here the real flash kernel and that stand-in get the same
    inputs (GQA, a window, five samples of 1-9 tokens across two rows) and must agree."""
    from finetune.model import attention
    from finetune.model.attention import sample_bounds

    if attention._varlen() is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn(window_size=...)")
    torch.manual_seed(0)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 0]])
    bounds = sample_bounds(position_ids)
    query, key, value = (torch.randn(2, heads, 12, 64, device="cuda", dtype=torch.bfloat16) for heads in (8, kv_heads, kv_heads))
    real = attention.varlen_attention(query, key, value, bounds, 0.125, torch.bfloat16, window)
    original, attention._varlen = attention._varlen, lambda: documented_varlen(True)
    try:
        want = attention.varlen_attention(query.float(), key.float(), value.float(), bounds, 0.125, torch.float32, window)
    finally:
        attention._varlen = original
    worst = (real.float() - want).abs().max().item()
    print(f"varlen kernel vs its CPU stand-in ({kv_heads} kv heads, window {window}): {worst:.1e}")
    assert worst < 2e-2  # bf16 output: ~3 significant digits of values near 1; a wrong cut or window is O(1)


@pytest.mark.parametrize("window", [None, 5])
def test_the_varlen_kernel_aligns_a_sample_reading_more_keys_than_queries_at_the_keys_end(window):
    """What GRPO's shared prompts need before they take the varlen kernel on GPUs (grpo.reads_shared_prompts keeps them on
    the CPU until then): a sample of 4 queries reading 7 keys (a 3-token prompt, then its own 4) sees the prompt and its
    own earlier tokens, the causal mask and the window aligned to the keys' end, as sdpa over that mask computes it."""
    from finetune.model import attention

    varlen_attn = attention._varlen()
    if varlen_attn is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn(window_size=...)")
    torch.manual_seed(0)
    q = torch.randn(4, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(7, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, n], dtype=torch.int32, device="cuda") for n in (4, 7))
    got = varlen_attn(q, k, v, cu_q, cu_k, 4, 7, scale=0.125, window_size=(-1 if window is None else window - 1, 0))
    allowed = attention._allowed(7, window, q.device)[3:]
    want = torch.nn.functional.scaled_dot_product_attention(*(x.float().transpose(0, 1) for x in (q, k, v)), attn_mask=allowed, scale=0.125)
    worst = (got.float() - want.transpose(0, 1)).abs().max().item()
    print(f"varlen kernel, 4 queries reading 7 keys (window {window}) against sdpa over the end-aligned mask: {worst:.1e}")
    assert worst < 2e-2


@pytest.mark.parametrize("path", ["varlen", "sdpa-mask"])
def test_packed_rows_on_cuda_never_attend_across_samples(tiny_model_dir, monkeypatch, path):
    """A packed row's logits (training mode) == each sample run alone, in bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from finetune.model import attention
    from finetune.model.attention import PACKED_SDPA, register, sample_bounds

    _attention_path(monkeypatch, path)
    batch = _packed_batch_cuda(tiny_model_dir)
    pad = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, attn_implementation=register()).cuda().train()
    assert model.config._attn_implementation == PACKED_SDPA
    with torch.no_grad():
        with attention.packed_rows():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.float()
        worst = 0.0
        for row, bounds in enumerate(sample_bounds(batch["position_ids"])):
            for s, e in zip(bounds, bounds[1:]):
                if (batch["input_ids"][row, s:e] == pad).all():
                    continue  # the padding segment
                alone = model(input_ids=batch["input_ids"][row : row + 1, s:e], use_cache=False).logits.float()[0]
                worst = max(worst, (packed[row, s:e] - alone).abs().max().item() / alone.abs().max().item())
    print(f"packed vs alone, bf16 {path} on CUDA: worst relative difference {worst:.2e}")
    assert worst < 2e-2  # bf16 rounding; attention across samples changes logits by O(1)


@pytest.mark.parametrize("impl", ["sdpa/varlen", "sdpa/sdpa-mask", "flash_attention_2"])
def test_packed_training_on_cuda_equals_eager_attention_over_the_block_mask(tiny_model_dir, monkeypatch, impl):
    """Logits and gradients of a packed batch: the kernel used in training == eager over the block-diagonal mask."""
    from transformers import AutoModelForCausalLM

    from finetune.model.attention import register

    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (it ships no wheels on PyPI)")
    if impl.startswith("sdpa/"):
        _attention_path(monkeypatch, impl.split("/")[1])
    batch = _packed_batch_cuda(tiny_model_dir)
    results = {}
    for name in ("eager", register() if impl.startswith("sdpa") else impl):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16, attn_implementation=name).cuda().train()
        results[name] = loss_and_grads(model, batch)
    (eager_loss, eager_grads), (loss, grads) = results.values()
    assert abs(loss - eager_loss) < 1e-2 * eager_loss, (loss, eager_loss)
    for name, grad in eager_grads.items():
        assert torch.allclose(grads[name].float(), grad.float(), rtol=5e-2, atol=5e-2 * grad.float().abs().max().item()), name


@pytest.mark.parametrize("path", ["varlen", "sdpa-mask"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma2"])  # Gemma 2 soft-caps: eager attention, no packed path
def test_packed_training_on_cuda_equals_each_sample_alone_in_every_family(family_dirs, monkeypatch, family, path):
    """Each family's packed batch (sliding windows, GQA, q/k norms, experts) in bf16 on CUDA: the loss
    and gradients of the training path equal eager attention and full logits on each sample alone."""
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.objectives import loss

    _attention_path(monkeypatch, path)
    model = load_model(ModelConfig(name_or_path=str(family_dirs(family)), dtype="bfloat16"), say=lambda _: None).cuda().train()
    samples = textbook_samples(model.config.vocab_size)
    model.zero_grad()
    packed = loss.token_loss_sum(model, {k: v.cuda() for k, v in samples_batch(samples, packed=True).items()})
    packed.backward()
    packed, grads = packed.item(), trained_grads(model)
    reference, reference_grads = textbook(model, samples, device="cuda")
    print(f"{family} {path}: packed {packed:.4f} vs each alone {reference:.4f}")
    assert abs(packed - reference) < 1e-2 * reference, (packed, reference)
    for name, grad in reference_grads.items():
        if family in MOE:
            # In bf16 a near-tie may send a token to another expert: then the gradients of that layer and
            # all below it move by ~10% as a whole (in fp32 they are equal: the test below).
            error = (grads[name].float() - grad.float()).norm() / grad.float().norm()
            print(f"{name}: off by {error.item():.3f}")
            assert error < 0.15, (name, error.item())
            continue
        assert torch.allclose(grads[name].float(), grad.float(), rtol=5e-2, atol=5e-2 * grad.float().abs().max().item()), name


@pytest.mark.parametrize("family", MOE)
def test_packed_moe_on_cuda_gets_the_same_gradients_in_fp32(family_dirs, monkeypatch, family):
    """Every gradient (bf16 rounding can flip a token's experts and move them) equals each sample
    alone's in fp32 (transformers' sdpa over the block mask: varlen takes bf16 only)."""
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.objectives import loss

    _attention_path(monkeypatch, "sdpa-mask")
    model = load_model(ModelConfig(name_or_path=str(family_dirs(family)), dtype="float32"), say=lambda _: None).cuda().train()
    samples = textbook_samples(model.config.vocab_size)
    model.zero_grad()
    loss.token_loss_sum(model, {k: v.cuda() for k, v in samples_batch(samples, packed=True).items()}).backward()
    grads = trained_grads(model)
    _, reference = textbook(model, samples, device="cuda")
    errors = {name: ((grads[name] - grad).norm() / grad.norm()).item() for name, grad in reference.items()}
    worst = max(errors, key=errors.get)
    print(f"{family}: fp32 gradients off by at most {errors[worst]:.2e} ({worst})")
    assert errors[worst] < 1e-4, (worst, errors[worst])


def test_fused_loss_on_cuda_equals_the_plain_loss(tiny_model_dir, monkeypatch):
    """linear_cross_entropy (used on CUDA too) == logits + cross-entropy: loss and gradients, bf16 weights."""
    from transformers import AutoModelForCausalLM

    from finetune.objectives import loss

    batch = _packed_batch_cuda(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().train()
    assert loss.fusable_parts(model) is not None
    fused = loss_and_grads(model, batch)
    monkeypatch.setattr(loss, "fusable_parts", lambda model: None)
    plain = loss_and_grads(model, batch)
    assert abs(fused[0] - plain[0]) < 1e-3 * plain[0], (fused[0], plain[0])
    for name, grad in plain[1].items():
        assert torch.allclose(fused[1][name].float(), grad.float(), rtol=2e-2, atol=2e-2 * grad.float().abs().max().item()), name


def test_fp8_trains_close_to_bf16(tmp_path, tiny_model_dir):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    _, bf16, _ = _train(tmp_path, tiny_model_dir, "bf16", adapter={"method": "full"}, train={"lr": 1e-3})
    _, fp8, _ = _train(tmp_path, tiny_model_dir, "fp8", adapter={"method": "full"}, train={"lr": 1e-3, "mixed_precision": "fp8"})
    print(f"fp8 {fp8[0]:.3f} -> {fp8[-1]:.3f}; bf16 {bf16[0]:.3f} -> {bf16[-1]:.3f}")
    assert fp8[-1] < 0.75 * fp8[0]
    assert abs(fp8[-1] - bf16[-1]) < 0.005 * bf16[-1]  # measured on an H100: 4.565 against 4.564


def test_optimizer_states_offloaded_to_cpu_train(tmp_path, tiny_model_dir):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed")
    _, plain, _ = _train(tmp_path, tiny_model_dir, "plain", adapter={"method": "full"}, train={"lr": 1e-3})
    _, offloaded, _ = _train(tmp_path, tiny_model_dir, "offload", adapter={"method": "full"}, train={"lr": 1e-3, "optimizer_offload": True})
    print(f"offloaded {offloaded[0]:.3f} -> {offloaded[-1]:.3f}; on GPU {plain[0]:.3f} -> {plain[-1]:.3f}")
    assert offloaded[-1] < 0.75 * offloaded[0]
    assert abs(offloaded[-1] - plain[-1]) < 0.05 * plain[-1]



def test_a_tiled_mlp_on_cuda_trains_as_the_untiled_one(tmp_path, tiny_model_dir):
    pytest.importorskip("deepspeed")
    checkpointed = {"gradient_checkpointing": True, "max_steps": 10}
    _, plain, _ = _train(tmp_path, tiny_model_dir, "plain", train=checkpointed)
    _, tiled, _ = _train(tmp_path, tiny_model_dir, "tiled", train=checkpointed, model={"tiled_mlp": 4})
    assert tiled == pytest.approx(plain, rel=2e-2)  # bf16: the chunks round apart
    assert tiled[-1] < 0.97 * tiled[0]  # 10 steps at lr 3e-3 from a random model: 0.94 on an H200; a run that does not learn stays at 1


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory, demo_tokenizer_dir):
    """Two decoder layers of the 1.1B Llama's widths (hidden 2048, MLP 5632, 32 heads, 4 key/value
    heads): what a long row costs a layer, at a size whose steps take a second."""
    from transformers import AutoTokenizer, LlamaConfig

    from finetune.model.tiny import write_random_model

    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=4, max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    return write_random_model(tmp_path_factory.mktemp("wide") / "model", config, tok, 2**30, say=lambda _: None)


def test_offloaded_activations_save_gpu_memory_on_8k_rows(tmp_path, wide_model_dir):
    """Rows of 8,192 tokens, bf16 LoRA, 3 steps: offloading what autograd saves takes it off the GPU
    with the same losses to the bit; a tiled MLP gives the untiled losses. Each run's peak is its own:
    train.run lets go of its model when it returns (before that fix, each run here started with the
    weights of the runs before still on the card)."""
    pytest.importorskip("deepspeed")  # the tiled MLP's

    def peak(name, **sections):
        _, losses, summary = _train(tmp_path, wide_model_dir, name, data={"max_seq_len": 8192},
                                    **{**sections, "train": {"max_steps": 3, "micro_batch_size": 1, "lr": 1e-4, **sections.get("train", {})}})
        return losses, summary["peak_gpu_mib"]

    checkpointed = {"gradient_checkpointing": True}
    runs = {"kept": peak("kept"), "offloaded": peak("offloaded", train={"offload_activations": True}),
            "checkpointed": peak("checkpointed", train=checkpointed),
            "checkpointed+offloaded": peak("checkpointed+offloaded", train={**checkpointed, "offload_activations": True}),
            "checkpointed+tiled": peak("checkpointed+tiled", train=checkpointed, model={"tiled_mlp": 4})}
    print("peak GPU MiB on 8k rows: " + ", ".join(f"{name} {mib:.0f}" for name, (_, mib) in runs.items()))
    losses, peaks = ({name: run[i] for name, run in runs.items()} for i in (0, 1))
    assert losses["offloaded"] == losses["kept"] and losses["checkpointed+offloaded"] == losses["checkpointed"]
    assert losses["checkpointed+tiled"] == pytest.approx(losses["checkpointed"], rel=1e-2)
    # Without checkpointing the two layers' saved tensors are ~1.7 GiB of the 1.9 (H200, each run in its own
    # process: bench/gpu_peak.py); offloaded, what stays is the weights and one layer's backward.
    assert peaks["offloaded"] < 0.7 * peaks["kept"]
    # With checkpointing only the layer inputs are saved (2 x 32 MiB): offloading them saves little (1,167
    # against 1,190 MiB, each in its own process), but never adds.
    assert peaks["checkpointed+offloaded"] < peaks["checkpointed"]


def test_nccl_with_one_rank_under_torchrun(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    cfg = base_config(tiny_model_dir, out, **BF16, train={"max_steps": 20, "micro_batch_size": 8, "lr": 1e-2, "mixed_precision": "bf16"},
                      distributed={"strategy": "ddp"})
    config = str(write_config(tmp_path / "c.yaml", cfg))
    result = subprocess.run([*torchrun(1), "finetune/train.py",
                             "--config", config], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert summary["backend"] == "nccl", summary["backend"]
    assert losses[-1] < 0.9 * losses[0], losses


# FSDP2 probes: one rank on this GPU, in a process of their own (a process group and sharded modules).
PROBE = r"""
import json, os, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
import torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
import test_gpu
print("RESULT " + json.dumps(getattr(test_gpu, sys.argv[2])(sys.argv[3])))
dist.destroy_process_group()
"""


def _probe(name: str, model_dir, port: int) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, str(REPO), name, str(model_dir), str(port)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _steps(model, batch, n: int, lr: float) -> list[float]:
    from finetune.objectives import loss

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    out = []
    for _ in range(n):
        value = loss.token_loss_sum(model, batch) / int((batch["labels"][:, 1:] != -100).sum())
        value.backward()
        opt.step()
        opt.zero_grad()
        out.append(value.item())
    return out


def fsdp2_cpu_offload(model_dir: str) -> dict:
    """finetune's shard_fsdp2 with CPU offload vs without (parameters, gradients and AdamW states on the GPU)."""
    from transformers import AutoModelForCausalLM

    from finetune.parallel.distributed import shard_fsdp2

    batch, out = _packed_batch_cuda(model_dir), {}
    for offload in (False, True):
        cfg = validate_config(base_config(model_dir, "unused", adapter={"method": "full"}, train={"mixed_precision": "bf16"},
                                          distributed={"strategy": "fsdp", "fsdp_cpu_offload": offload}), "test")
        sharded = shard_fsdp2(AutoModelForCausalLM.from_pretrained(model_dir), cfg, torch.device("cuda", 0), 1)
        out["offloaded" if offload else "reference"] = _steps(sharded, batch, 5, 1e-3)
        out["param_devices"] = sorted({p.device.type for p in sharded.parameters()})
    return out


def fsdp2_qlora(model_dir: str) -> dict:
    """FSDP2 over a 4-bit base whose packed values are stored in bf16 (bnb_4bit_quant_storage), LoRA on top:
    does the quantization state survive sharding, and does it train like the unsharded model?"""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from finetune.model.loading import decoder_layers

    def qlora():
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=quant, device_map={"": 0})
        torch.manual_seed(0)
        return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))

    batch = _packed_batch_cuda(model_dir)
    reference = _steps(qlora(), batch, 8, 3e-3)
    model = qlora()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    try:
        for layer in decoder_layers(model):
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        sharded = _steps(model, batch, 8, 3e-3)
        error = None
    except Exception as err:  # noqa: BLE001 - the probe reports what FSDP2 + bitsandbytes do, whatever it is
        sharded, error = [], f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    return {"reference": reference, "sharded": sharded, "error": error}


def test_fsdp2_qlora_with_cpu_offload_in_one_process_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """torch's FSDP2 skips the all-gather of a one-process group and copies one input per parameter, which
    loses NF4Tensor's three parts (ValueError in torchao's fsdp_post_all_gather, seen on an H200 and on CPU;
    2 processes run): fsdp_cpu_offload with a torchao base in one process is refused before loading."""
    from conftest import finetune_in_process

    cfg = base_config(tiny_model_dir, tmp_path / "out", model={"dtype": "bfloat16", "quantization": {"bits": 4, "backend": "torchao"}},
                      train={"mixed_precision": "bf16"}, distributed={"strategy": "fsdp", "fsdp_cpu_offload": True})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "c.yaml", cfg)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "distributed.fsdp_cpu_offload: with a torchao 4-bit base it needs 2+ processes" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_fsdp2_with_cpu_offload_trains_like_the_unsharded_model(tiny_model_dir):
    result = _probe("fsdp2_cpu_offload", tiny_model_dir, free_port())
    print(f"fsdp2 cpu offload: {result}")
    assert result["param_devices"] == ["cpu"]
    assert result["offloaded"] == pytest.approx(result["reference"], rel=5e-3)
    assert result["offloaded"][-1] < result["offloaded"][0]


def test_fsdp2_over_a_4bit_base_trains_like_the_unsharded_model(tiny_model_dir):
    """On CUDA, FSDP2 keeps bitsandbytes' 4-bit state (packed values stored in bf16) and trains as the
    unsharded QLoRA model does (on CPU its DTensors drop that state). finetune still refuses fsdp +
    quantization: its multi-rank load and DCP checkpoints of a 4-bit base need several GPUs to test."""
    result = _probe("fsdp2_qlora", tiny_model_dir, free_port())
    print(f"fsdp2 + qlora: {result}")
    assert result["error"] is None, result["error"]
    assert result["reference"][-1] < 0.97 * result["reference"][0]
    assert result["sharded"] == pytest.approx(result["reference"], rel=1e-3)


def test_loftq_starts_a_4bit_base_nearer_the_full_precision_model(tiny_model_dir):
    """LoftQ's A and B fit each 4-bit layer's quantization error: before any step, the adapted 4-bit
    model's logits are nearer the bf16 model's than QLoRA's (B = 0: the 4-bit base alone)."""
    from finetune.config.schema import AdapterConfig, ModelConfig
    from finetune.model.loading import apply_adapter, load_model, loftq_init

    batch = _eval_batch(tiny_model_dir)
    bf16 = ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16")
    reference = _logits(load_model(bf16, say=lambda _: None).cuda(), batch)
    error = {}
    for init in ("default", "loftq"):
        cfg = ModelConfig(name_or_path=str(tiny_model_dir), dtype="bfloat16", quantization={"bits": 4})
        model = apply_adapter(load_model(cfg, device="cuda", say=lambda _: None), AdapterConfig(init=init), False, say=lambda _: None)
        if init == "loftq":
            loftq_init(model, cfg)
        error[init] = (_logits(model, batch) - reference).norm().item() / reference.norm().item()
    print(f"logits' distance to bf16: QLoRA {error['default']:.4f}, LoftQ {error['loftq']:.4f}")
    assert error["default"] > 1e-3  # quantization moved the logits
    assert error["loftq"] < 0.9 * error["default"], error


def test_fsdp_qlora_under_torchrun_on_cuda_trains_as_one_process(tmp_path, tiny_model_dir):
    """Issue 56 on CUDA: finetune's fsdp engine over torchao's NF4 base (nccl, one rank under torchrun)
    gives the one-process torchao QLoRA losses, and both learn as bitsandbytes' QLoRA does."""
    sections = {"model": {"dtype": "bfloat16", "quantization": {"bits": 4, "backend": "torchao"}}, "data": {"eval": None},
                "train": {"max_steps": 12, "micro_batch_size": 8, "lr": 3e-3, "mixed_precision": "bf16"}}
    out = tmp_path / "fsdp"
    config = str(write_config(tmp_path / "fsdp.yaml", base_config(tiny_model_dir, out, **sections, distributed={"strategy": "fsdp"})))
    result = subprocess.run([*torchrun(1), "finetune/train.py",
                             "--config", config], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["nf4_bytes_per_rank"][0] > 0, summary
    _, one, _ = _train(tmp_path, tiny_model_dir, "one", **sections)
    sections["model"]["quantization"] = {"bits": 4, "backend": "bitsandbytes"}
    _, bnb, _ = _train(tmp_path, tiny_model_dir, "bnb", **sections)
    print(f"fsdp torchao {sharded}\none process torchao {one}\nbitsandbytes {bnb}")
    assert sharded == one  # one rank: the same NF4 weights, the same order of operations
    assert sharded[-1] < sharded[0] - 0.4 and sharded == pytest.approx(bnb, rel=1e-3), (sharded, bnb)


# Vision-language models on CUDA (tests/test_vision.py proves the CPU paths): the tiny LLaVA and its picture rows.
from test_vision import _config as _vision_config  # noqa: E402
from test_vision import _split as _vision_split  # noqa: E402
from test_vision import _tuned_model, llava, picture_data  # noqa: E402, F401 - fixtures


def test_packed_picture_rows_on_cuda_equal_one_sample_a_row(llava, picture_data, tmp_path):  # noqa: F811
    """LLaVA's packed rows in bf16 on CUDA (transformers' sdpa keeps the samples apart by their restarting
    positions): loss and LoRA gradients equal the same samples one a row."""
    from finetune.config.schema import ModelConfig
    from finetune.model.loading import load_model
    from finetune.objectives.loss import losses, to_device

    model_dir = llava("clip")
    packed, _, tokenizer = _vision_split(model_dir, picture_data, tmp_path, packing=True)
    unpacked, *_ = _vision_split(model_dir, picture_data, tmp_path / "unpacked")
    rows = [0, 1, 2]
    samples = [int(x) for r in rows for x in packed.samples[packed.order[packed.offsets[r] : packed.offsets[r + 1]]]]
    row_of = {int(x): i for i, x in enumerate(unpacked.samples)}
    torch.manual_seed(0)
    model = _tuned_model(load_model(ModelConfig(name_or_path=str(model_dir), dtype="bfloat16"), say=lambda _: None).cuda().train())
    results = []
    for split, which in ((packed, rows), (unpacked, [row_of[x] for x in samples])):
        model.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            value = losses(model, to_device(split.batch(which, tokenizer.pad_token_id), "cuda")).tokens
        value.backward()
        results.append((value.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, grads_a), (b, grads_b) = results
    print(f"LLaVA on CUDA, bf16: packed {a:.5f} vs one a row {b:.5f}")
    assert abs(a - b) < 1e-2 * abs(b), (a, b)
    for name, grad in grads_b.items():
        error = ((grads_a[name] - grad).norm() / grad.norm()).item()
        assert error < 5e-2, (name, error)


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16-lora", "qlora"])
def test_vision_lora_and_qlora_on_cuda_learn_and_merge(tmp_path, llava, picture_data, quantized):  # noqa: F811
    """bf16 LoRA and bitsandbytes QLoRA (the language model quantized, the tower kept) of the tiny LLaVA on
    CUDA: the loss falls, and the merged model reloads in transformers and answers from a picture."""
    from conftest import finetune_in_process

    model = {"dtype": "bfloat16", **({"quantization": QLORA} if quantized else {})}
    cfg = _vision_config(llava("clip"), picture_data, tmp_path / "out", model=model, train={"mixed_precision": "bf16", "max_steps": 12})
    result = finetune_in_process("train", "--config", str(write_config(tmp_path / "run.yaml", cfg)))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    print(f"LLaVA {'QLoRA' if quantized else 'bf16 LoRA'} on CUDA: {losses}")
    assert losses[-1] < losses[0] - 0.5, losses
    merged = finetune_in_process("merge", "--adapter", str(tmp_path / "out"), "--out", str(tmp_path / "merged"))
    assert merged.returncode == 0, merged.stderr[-3000:]
    report = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    print(f"merge report: {report}")
    assert report["check_pictures"] == 4 and report["passed"], report


def test_grpo_on_cuda_samples_through_a_static_cache_and_repeats_itself(tmp_path, tiny_model_dir):
    """grpo.kv_cache static on CUDA (transformers compiles the decoding step): a LoRA GRPO run in bf16 samples through
    it, and a second run repeats the first's rewards and losses (what resume and 2 processes rest on). Its first run on
    an H200 raised in the rollout: bf16 weights, fp32 LoRA, no autocast (any cache; fixed, tests/test_grpo.py)."""
    from conftest import DEMO_DATA

    def run_once(name):
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(True)
        out = tmp_path / name
        cfg = base_config(tiny_model_dir, out, model={"dtype": "bfloat16"},
                          data={"train": str(DEMO_DATA / "prompts-train.jsonl"), "eval": None, "format": "prompt", "max_seq_len": 64},
                          train={"objective": "grpo", "max_steps": 3, "micro_batch_size": 4, "lr": 5e-3, "mixed_precision": "bf16"},
                          grpo={"num_generations": 4, "max_completion_length": 16, "rewards": ["length"], "kv_cache": "static"},
                          eval={"on_start": False})
        run(validate_config(cfg, "test"))
        return [(r["loss"], r["reward"]) for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]

    first, second = run_once("a"), run_once("b")
    print(f"GRPO through a static cache on CUDA: {first}")
    assert first == second and len(first) == 3
